"""The single-device speed paths give the training of the plain ones: the head and loss fused over chunks of
tokens, and torch.compile per block (fp32, one process, losses and final weights within the parity
tolerances)."""
import pytest
import torch

from sixfold.config import ConfigError, load_config
from sixfold.generate import generate
from sixfold.logs import read_metrics
from sixfold.mesh import ParallelContext
from sixfold.model.head_loss import chunked_head_loss
from sixfold.model.llama import Llama, init_weights
from sixfold.parity import LOSS_RTOL, WEIGHT_RTOL
from sixfold.train import Trainer
from helpers import TINY, sixfold

STEPS = 3


def train(tmp_path, *overrides):
    cfg = load_config(TINY, [f"log.run_dir={tmp_path}", "checkpoint.save_final=false", *overrides])
    trainer = Trainer(cfg, ParallelContext.single())
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def assert_same_training(a, b):
    (losses_a, weights_a), (losses_b, weights_b) = a, b
    assert max(abs(x - y) / abs(y) for x, y in zip(losses_a, losses_b)) <= LOSS_RTOL, (losses_a, losses_b)
    for name, w in weights_b.items():
        rel = (weights_a[name] - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()
        assert rel <= WEIGHT_RTOL, (name, float(rel))


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_head_loss_trains_as_the_whole_logits(tmp_path, tied):
    """100-token chunks of a 256-token micro-batch (the last chunk shorter)."""
    tie = f"model.tie_embeddings={str(tied).lower()}"
    assert_same_training(train(tmp_path / "chunked", tie, "model.loss_chunk=100"), train(tmp_path / "whole", tie))


def test_chunked_head_loss_ignores_masked_labels():
    torch.manual_seed(0)
    h, w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True), torch.randn(40, 16, dtype=torch.float64)
    labels = torch.randint(0, 40, (50,))
    labels[::3] = -100
    w.requires_grad_()
    chunked_head_loss(h, w, labels, 7).mul(0.5).backward()
    ours = [h.grad.clone(), w.grad.clone()]
    h.grad = w.grad = None
    torch.nn.functional.cross_entropy(h @ w.t(), labels, ignore_index=-100, reduction="sum").mul(0.5).backward()
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(ours, [h.grad, w.grad]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU's products add bf16 into fp32 in place"))])
def test_chunked_head_loss_in_bf16_is_the_fp64_loss_to_bf16_round_off(device):
    """bf16 inputs, three chunks: loss and gradients against fp64 on the same (rounded) inputs."""
    torch.manual_seed(0)
    h, w = torch.randn(300, 64).bfloat16(), (torch.randn(500, 64) * 0.1).bfloat16()
    labels = torch.randint(0, 500, (300,))
    labels[::5] = -100
    ref = [h.double().requires_grad_(), w.double().requires_grad_()]
    loss = torch.nn.functional.cross_entropy(ref[0] @ ref[1].t(), labels, ignore_index=-100, reduction="sum")
    loss.mul(0.5).backward()
    ours = [h.to(device).requires_grad_(), w.to(device).requires_grad_()]
    got = chunked_head_loss(*ours, labels.to(device), 128)
    got.mul(0.5).backward()
    assert abs(float(got.detach()) - float(loss.detach())) / float(loss.detach()) < 1e-3
    for a, b in zip(ours, ref):
        assert a.grad.dtype == torch.bfloat16
        assert float((a.grad.double().cpu() - b.grad).norm() / b.grad.norm()) < 1e-2


@pytest.mark.parametrize("model", [[], ["model.moe_experts=4"]], ids=["dense", "moe"])
def test_compiled_blocks_train_as_eager(tmp_path, model):
    """An MoE layer runs eagerly inside its compiled block (its shapes follow the routing)."""
    assert_same_training(train(tmp_path / "compiled", "train.compile=true", *model), train(tmp_path / "eager", *model))


def test_compiled_blocks_still_defer_weight_gradients():
    # pipeline B's queue their weight gradients (W, or an early send's); a compiled block must too
    cfg = load_config(TINY, ["train.compile=true", "log.run_dir=/tmp/unused"])
    model = Trainer(cfg, ParallelContext.single()).model
    wg, block = model.tp.weight_grads, model.layers["0"]
    wg.used = True
    x = torch.randn(64, model.cfg.dim, requires_grad=True)
    for defer in (False, True):  # traced where it does not defer, as the first forward of a pipeline
        out = block(x, model.tokens(2, 32, x.device)).sum()
        wg.defer = defer
        out.backward()
        wg.defer = False
        assert len(wg.take()) == (4 if defer else 0)  # qkv, wo, gate and up, down


def test_a_compiled_block_runs_without_gradients_in_one_graph():
    """Evaluation and the sample: the stacked products are plain linear layers inside the block's graph (their
    Function broke it at each product, and dynamo printed a warning of it), as eager gives."""
    model, eager = Llama(load_config(TINY).model), Llama(load_config(TINY).model)
    init_weights(model, 0)
    init_weights(eager, 0)
    torch._dynamo.reset()
    model.compile_blocks(backend="eager", fullgraph=True)
    x = torch.randn(64, model.cfg.dim)
    with torch.no_grad():
        out = model.layers["0"](x, model.tokens(2, 32, x.device))
        assert torch.allclose(out, eager.layers["0"](x, eager.tokens(2, 32, x.device)), atol=1e-6, rtol=0)


def test_a_compiled_model_generates_without_compiling_again():
    """Generation's KV cache grows with every token: the compiled blocks leave it to eager code (each layer and
    length compiled again), and the tokens are eager's."""
    model, eager = Llama(load_config(TINY).model), Llama(load_config(TINY).model)
    init_weights(model, 0)
    init_weights(eager, 0)
    torch._dynamo.reset()
    model.compile_blocks(backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        model.loss_sum(*torch.randint(0, 320, (2, 2, 32)))  # compiled once, without gradients, as evaluation is
        got = generate(model, [1, 2, 3], 6)
    assert got == generate(eager, [1, 2, 3], 6)


def test_loss_chunk_under_tp_is_refused():
    with pytest.raises(ConfigError, match="model.loss_chunk=0"):
        load_config(TINY, ["parallel.tp=2", "model.loss_chunk=64"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies to a GPU behind queued work")
def test_batches_staged_behind_queued_cuda_work_arrive_whole():
    """Each host tensor sent while the device is still busy arrives as it was sent, though the host pins the next
    ones (of the same size) before any copy has run."""
    from sixfold.staging import to_device
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(30):  # tens of milliseconds of queued work
        a = torch.nn.functional.normalize(a @ a, dim=1)
    sent = [torch.full((1 << 14,), i, dtype=torch.long) for i in range(8)]
    got = [to_device(t, "cuda") for t in sent]
    assert all(torch.equal(g.cpu(), t) for g, t in zip(got, sent))
    assert to_device(sent[0], "cpu") is sent[0]


def test_compiled_blocks_under_tp_leave_the_collectives_to_eager_code(tmp_path):
    """The linear layers' collectives (their ledger, timing and roll call) run outside the compiled graphs: no
    warning of what the compiler cannot trace, and the training of eager blocks."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["train.compile=true"])):
        proc = sixfold("train", TINY, "parallel.tp=2", f"train.steps={STEPS}", *extra,
                       f"log.run_dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Dynamo" not in proc.stderr, proc.stderr[-3000:]
        runs[name] = [m["loss"] for m in read_metrics(tmp_path / name)]
    assert max(abs(x - y) / abs(y) for x, y in zip(runs["compiled"], runs["eager"])) <= LOSS_RTOL, runs
