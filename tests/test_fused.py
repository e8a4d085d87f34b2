"""The hand-written backward of the model's norm, attention heads and SwiGLU: their gradients against finite
differences in fp64 (parity across layouts cannot see a wrong one: every layout runs the same), and their
forward against autograd's own operations written as Hugging Face writes them."""
import pytest
import torch
import torch.nn.functional as F

from sixfold.model.fused import attention_heads, rms_norm, swiglu
from sixfold.model.llama import rope_tables

D = torch.float64


def _norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


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
    cos, sin = (t.to(D) for t in rope_tables(torch.arange(3, 3 + s), hd, 10000.0))
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
