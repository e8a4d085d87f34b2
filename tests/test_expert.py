"""Expert parallelism's pieces: dispatch bytes, outputs and waits for the device against one process; the experts'
Function against autograd; the router's weights. Whole-run parity is in test_parity.py, Mixtral interop in
test_hf.py, bad layouts in test_config.py."""
import pytest
import torch

from sixfold.config import ConfigError, load_config
from sixfold.model.hf import hf_config_from_model
from sixfold.model.llama import Llama, init_weights
from sixfold.model.moe import _Grouped, routing_warning
from sixfold.parallel.tensor import WeightGrads
from helpers import TINY, torchrun


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_bytes_equal_the_formula_outputs_one_process_and_wait_for_the_device_once(ep):
    proc = torchrun("expert_bytes.py", ep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("expert bytes OK") == ep


@pytest.mark.parametrize("model", ["dense", "moe", "mixed"])
def test_zero3_gathers_each_unit_ahead_of_its_backward(model):
    proc = torchrun("zero3_prefetch.py", 2, model)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{model} prefetch OK" in proc.stdout


def test_experts_function_equals_autograd_and_adds_into_the_gradients():
    """fp64, 3 experts (one with no rows): outputs and gradients as autograd's per-expert products give them.
    Weight gradients are added into .grad (made on the first backward); the weights' post-accumulate hooks run
    once per backward, and deferred (a zero-bubble pipeline's B) the work queued runs them later and then tells
    on_grad (its W). A frozen weight gets no gradient; a second derivative is refused."""
    gen = torch.Generator().manual_seed(0)
    counts, f, h = [5, 0, 7], 24, 16
    rows = torch.randn(12, h, dtype=torch.float64, generator=gen, requires_grad=True)
    weights = [torch.randn(3, *shape, dtype=torch.float64, generator=gen, requires_grad=True)
               for shape in ((f, h), (f, h), (h, f))]
    grad = torch.randn(12, h, dtype=torch.float64, generator=gen)
    expected = torch.cat([(torch.nn.functional.silu(piece @ gate.t()) * (piece @ up.t())) @ down.t()
                          for piece, gate, up, down in zip(rows.split(counts), *(w.unbind() for w in weights))])
    expected.backward(grad)
    want = [t.grad.clone() for t in (rows, *weights)]
    for t in (rows, *weights):
        t.grad = None
    hooked, told, grads = [], [], WeightGrads()
    grads.on_grad = told.append
    for w in weights:
        w.register_post_accumulate_grad_hook(hooked.append)
    for times in (1, 2, 3):
        grads.defer = times == 3
        out = _Grouped.apply(rows, counts, grads, *weights)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        out.backward(grad)
        assert sorted(map(id, hooked)) == sorted(map(id, weights * times)) and not told
        if grads.defer:
            assert len(grads.pending) == 1
            torch.testing.assert_close(weights[0].grad, 2 * want[1], rtol=1e-12, atol=1e-12)
            grads.run()
            assert sorted(map(id, told)) == sorted(map(id, weights))
        for got, w in zip((rows.grad, *(w.grad for w in weights)), want):
            torch.testing.assert_close(got, times * w, rtol=1e-12, atol=1e-12)
    grads.defer = False
    weights[1].requires_grad_(False)
    before = [w.grad.clone() for w in weights]
    _Grouped.apply(rows, counts, grads, *weights).backward(grad)
    torch.testing.assert_close(weights[1].grad, before[1], rtol=0, atol=0)
    torch.testing.assert_close(weights[2].grad, before[2] + want[3], rtol=1e-12, atol=1e-12)
    out = _Grouped.apply(rows, counts, grads, *weights)
    (first,) = torch.autograd.grad(out, rows, grad.clone().requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        first.sum().backward()


def _router_grad(norm_topk: bool) -> float:
    """The largest router gradient of a top-1 model from the language-model loss alone."""
    cfg = load_config(TINY, ["model.moe_experts=4", "model.moe_top_k=1", f"model.moe_norm_topk={norm_topk}",
                             "model.moe_aux_weight=0", "model.moe_z_weight=0"], check=False).model
    model = Llama(cfg)
    init_weights(model, 0)
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    model.loss_sum(x, x).backward()
    return max(float(p.grad.abs().max()) for n, p in model.named_parameters() if "router" in n)


def test_top1_router_learns_from_the_loss_only_with_switch_weights():
    switch = _router_grad(norm_topk=False)
    assert switch > 1e-3
    assert _router_grad(norm_topk=True) < 1e-5 * switch  # a renormalised single weight is 1: round-off only
    top1 = load_config(TINY, ["model.moe_experts=4", "model.moe_top_k=1"]).model
    assert "set model.moe_norm_topk=false" in routing_warning(top1)  # shown by rank 0 as training starts
    assert not routing_warning(load_config(TINY, ["model.moe_experts=4", "model.moe_top_k=1",
                                                  "model.moe_norm_topk=false"]).model)
    cfg = load_config(TINY, ["model.moe_experts=4", "model.moe_norm_topk=false"]).model
    with pytest.raises(ConfigError, match="Mixtral renormalises"):
        hf_config_from_model(cfg)
