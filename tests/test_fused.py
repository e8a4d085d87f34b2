"""The hand-written backward of the model's norm, attention heads and SwiGLU: their gradients against finite
differences in fp64 (parity across layouts cannot see a wrong one: every layout runs the same), and their
forward against autograd's own operations written as Hugging Face writes them."""
from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sixfold.activations import SavedTensors
from sixfold.model.fused import attention_heads, norm_again, rms_norm, swiglu, swiglu_again
from sixfold.config import ModelConfig, load_config
from sixfold.model.llama import Llama, init_weights, rope_frequencies, rope_tables
from sixfold.parallel.tensor import TensorParallel, linear, note_laid_out

D = torch.float64


def _norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def frequencies(head_dim: int) -> torch.Tensor:
    """Plain RoPE's, theta 10000, for one head of head_dim."""
    return rope_frequencies(ModelConfig(dim=head_dim, n_heads=1, rope_theta=10000.0))


def _rotate_half(x, cos, sin):
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def test_rms_norm():
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 8, dtype=D, requires_grad=True), torch.randn(8, dtype=D, requires_grad=True)
    assert torch.allclose(rms_norm(x, w, 1e-6), _norm(x, w, 1e-6), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6), (x, w))


@pytest.mark.parametrize("n_q, n_kv", [(4, 4), (4, 2), (2, 1)])
def test_attention_heads(n_q, n_kv):
    torch.manual_seed(0)
    b, s, hd = 2, 5, 8
    x = torch.randn(b, s, n_q + 2 * n_kv, hd, dtype=D, requires_grad=True)
    cos, sin = (t.to(D) for t in rope_tables(torch.arange(3, 3 + s), frequencies(hd)))
    q, k, v = attention_heads(x, n_q, n_kv, cos, sin)
    rq, rk, rv = x.split([n_q, n_kv, n_kv], 2)
    for ours, ref in ((q, _rotate_half(rq, cos, sin)), (k, _rotate_half(rk, cos, sin)), (v, rv)):
        assert ours.shape == (b, ref.shape[2], s, hd)
        assert torch.allclose(ours, ref.transpose(1, 2), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: attention_heads(x, n_q, n_kv, cos, sin), (x,))


def test_swiglu():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 12, dtype=D, requires_grad=True)
    gate, up = x.chunk(2, -1)
    assert torch.allclose(swiglu(x), F.silu(gate) * up, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(swiglu, (x,))


@pytest.mark.parametrize("op", ["norm", "swiglu"])
def test_a_linear_layer_computes_its_input_again_rather_than_save_it(op):
    """The norm's output (the q, k, v and the gate and up products' input) and SwiGLU's (w_down's): the linear
    layer computes it again in backward from what the norm or SwiGLU saves anyway. The gradients against finite
    differences in fp64, and what is saved for backward: the operation's input (and the norm's statistics), not
    its output."""
    torch.manual_seed(0)
    x = torch.randn(6, 8, dtype=D, requires_grad=True)
    norm = op == "norm"
    params = nn.ParameterList([torch.randn(5, 8 if norm else 4, dtype=D), *([torch.randn(8, dtype=D)] if norm else [])])
    tp = TensorParallel()

    def run(x, w, *scale):
        h, again = norm_again(x, scale[0], 1e-6) if norm else swiglu_again(x)
        return linear(tp, h, [w], "column" if norm else "row", False, again=again)

    assert torch.autograd.gradcheck(run, (x, *params))
    plain = rms_norm(x, params[1], 1e-6) if norm else swiglu(x)
    assert torch.allclose(run(x, *params), plain @ params[0].t(), rtol=0, atol=1e-12)
    with SavedTensors(params) as saved:
        run(x, *params)
    assert [s.shape for s in saved.saved] == ([(6, 8), (6, 1)] if norm else [(6, 8)])


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a GPU's bf16 kernels"))])
def test_bf16_forward_and_backward_are_fp64_to_bf16_round_off(device, compiled):
    """Norm, heads and SwiGLU chained in bf16, eager or compiled into one graph: output and input gradients
    against fp64 on the same rounded inputs."""
    torch.manual_seed(0)
    b, s, n_q, n_kv, hd = 2, 64, 4, 2, 16
    dim = (n_q + 2 * n_kv) * hd
    x, w = torch.randn(b, s, dim).bfloat16(), (1 + 0.1 * torch.randn(dim)).bfloat16()
    cos, sin = rope_tables(torch.arange(s), frequencies(hd))
    grads = [torch.randn(b, n, s, hd).bfloat16() for n in (n_q, n_kv, n_kv)]
    grads.append(torch.randn(b, s, dim // 2).bfloat16())

    def chain(x, w, cos, sin):
        h = rms_norm(x, w, 1e-5)
        return (*attention_heads(h.view(b, s, n_q + 2 * n_kv, hd), n_q, n_kv, cos, sin), swiglu(h))

    def run(dtype, where, fn):
        inputs = [t.to(where, dtype).detach().requires_grad_() for t in (x, w)]
        outs = fn(*inputs, cos.to(where), sin.to(where))
        torch.autograd.backward(outs, [g.to(where, dtype) for g in grads])
        return [t.detach().double().cpu() for t in (*outs, *(i.grad for i in inputs))]

    ours = run(torch.bfloat16, device, torch.compile(chain, fullgraph=True) if compiled else chain)
    for a, ref in zip(ours, run(D, "cpu", chain)):
        assert float((a - ref).norm() / ref.norm()) < 1e-2


def _lay_out(model: Llama) -> None:
    """The parameters one after another in one flat tensor, as a unit's flat buffer holds them."""
    params = list(model.parameters())
    flat = torch.cat([p.detach().flatten() for p in params])
    for p, o in zip(params, accumulate([0] + [p.numel() for p in params])):
        p.data = flat[o:o + p.numel()].view_as(p)
    note_laid_out(model)


@pytest.mark.parametrize("laid_out", [False, True])
def test_a_block_compiles_into_one_graph(laid_out):
    """train.compile compiles each block's forward: a graph break would leave its pieces (and their backward)
    eager. Compiled, the block gives eager's output and gradients, also at a second sequence length (which the
    compiler traces again with the length symbolic). Its stacked weights (qkv, gate and up) are copied into one
    product only where they do not lie one after another in one buffer."""
    torch.manual_seed(0)
    model = Llama(load_config("configs/tiny.yaml", []).model)
    init_weights(model, 0)
    if laid_out:
        _lay_out(model)
    block = model.layers["0"]
    cats, traces = [], []

    def inductor(gm, inputs):
        from torch._inductor.compile_fx import compile_fx  # torch.compile's default backend
        traces.append(gm)
        cats.extend(tuple(n.meta["example_value"].shape) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                    for n in m.graph.nodes if n.target is torch.cat)
        return compile_fx(gm, inputs)

    compiled = torch.compile(block.forward, fullgraph=True, backend=inductor)
    for s in (16, 24):
        x, t = torch.randn(2 * s, model.cfg.dim), model.tokens(2, s, torch.device("cpu"))
        results = []
        for forward in (block.forward, compiled):
            block.zero_grad()
            inp = x.clone().requires_grad_()
            out = forward(inp, t)
            out.backward(torch.ones_like(out))
            results.append([out.detach(), inp.grad, *(p.grad.clone() for p in block.parameters())])
        for a, b in zip(*results):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), s
    stacks = [(sum(w.shape[0] for w in m.stacked()), model.cfg.dim) for m in (block.attn, block.mlp)]
    copies = sum(shape in stacks for shape in cats)
    # per trace, qkv and gate/up in forward and in backward (one trace or two: a length may already be dynamic)
    assert traces and copies == (0 if laid_out else 4 * len(traces))
