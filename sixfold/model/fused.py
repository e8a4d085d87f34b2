"""RMSNorm, the attention heads (rotary embedding) and SwiGLU as autograd Functions with hand-written backward.

Autograd's chain of small operations makes several passes over memory and saves their intermediates; these make
fewer passes and save only their input (the norm: and its per-token statistics) or nothing (rotation: the tables).
The norm's output and SwiGLU's, the inputs of linear layers, are not saved at all where the layer computes them
again in its backward from what they save (norm_again, swiglu_again).
Under torch.compile (train.compile) the plain operations run instead: the compiler derives their backward and fuses
both into few kernels itself, where the Functions' writes into slices would split its graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..parallel.tensor import Again


def _wide(x: torch.Tensor) -> torch.dtype:
    """fp32, or x's dtype if wider."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNormFunction(torch.autograd.Function):
    """weight * (x / rms(x)).to(x.dtype), the statistics in fp32 or wider (Hugging Face's LlamaRMSNorm)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        """The output and the per-token 1 / rms(x)."""
        h = x.to(_wide(x))
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        ctx.mark_non_differentiable(rstd)
        return _normed(h, weight, rstd, x.dtype), rstd

    @staticmethod
    def backward(ctx, grad, _):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype)
        dweight = (g * xhat).flatten(0, -2).sum(0).to(weight.dtype)
        gy = g * weight.to(rstd.dtype)
        # d/dx of x * rstd(x): rstd * (gy - xhat * mean(gy * xhat))
        mean = (gy * xhat).mean(-1, keepdim=True)
        dx = gy.sub_(xhat.mul_(mean)).mul_(rstd)
        return dx.to(x.dtype), dweight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.compiler.is_compiling():
        h = x.to(_wide(x))
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return weight * y
    return RMSNormFunction.apply(x, weight, eps)[0]


def _normed(h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The norm's output in `dtype` from its input h in rstd's dtype."""
    y = (h * rstd).to(dtype)
    return y.mul_(weight) if weight.dtype == y.dtype else weight * y


def norm_again(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, Again | None]:
    """rms_norm(x) for a linear layer's input, and how the layer computes it again from the norm's own saved
    tensors (None without gradients, and under torch.compile, which chooses what to save)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return rms_norm(x, weight, eps), None
    y, rstd = RMSNormFunction.apply(x, weight, eps)
    return y, Again(lambda x, rstd: _normed(x.to(rstd.dtype), weight, rstd, x.dtype), (x, rstd))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float, out: torch.Tensor) -> None:
    """Each head's halves (x1, x2) turned by the angle (sign +1) or back (-1) into out: (x1 cos - x2 sin,
    x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-sign)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin, value=sign)


class HeadsFunction(torch.autograd.Function):
    """The product of the stacked q, k, v weights into rotated q and k and v, as [b, heads, s, head_dim] views
    of one new buffer; the gradient comes back as one tensor of the product's layout. The rotation's gradient is
    the inverse rotation, so nothing but the tables is saved."""

    @staticmethod
    def forward(ctx, x, n_q: int, n_kv: int, cos, sin):
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        ctx.save_for_backward(cos, sin)
        ctx.n_q, ctx.n_qk = n_q, n_q + n_kv
        out = torch.empty_like(x)
        _rotate(x[:, :, :ctx.n_qk], cos, sin, 1.0, out[:, :, :ctx.n_qk])
        out[:, :, ctx.n_qk:] = x[:, :, ctx.n_qk:]
        q, k, v = out.transpose(1, 2).split([n_q, n_kv, n_kv], 1)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        n_q, n_qk = ctx.n_q, ctx.n_qk
        dx = torch.empty(dq.shape[0], dq.shape[2], n_qk + dv.shape[1], dq.shape[3], dtype=dq.dtype, device=dq.device)
        _rotate(dq.transpose(1, 2), cos, sin, -1.0, dx[:, :, :n_q])
        _rotate(dk.transpose(1, 2), cos, sin, -1.0, dx[:, :, n_q:n_qk])
        dx[:, :, n_qk:] = dv.transpose(1, 2)
        return dx, None, None, None, None


def attention_heads(x: torch.Tensor, n_q: int, n_kv: int, cos: torch.Tensor, sin: torch.Tensor):
    """x [b, s, n_q + 2 n_kv, head_dim] (q, k, v heads) -> q, k rotated by the angles of the s positions and v,
    each [b, heads, s, head_dim]; cos, sin [s, 1, head_dim / 2]."""
    if torch.compiler.is_compiling():
        qk, v = x.transpose(1, 2).split([n_q + n_kv, n_kv], 1)
        half = x.shape[-1] // 2
        x1, x2 = qk[..., :half], qk[..., half:]
        cos, sin = (t.to(x.dtype).transpose(0, 1) for t in (cos, sin))
        q, k = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).split([n_q, n_kv], 1)
        return q, k, v
    return HeadsFunction.apply(x, n_q, n_kv, cos, sin)


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up from x = [gate | up] (one product of the stacked weights); the gradient comes out as one
    tensor of x's layout, and silu(gate) is computed again in backward rather than saved."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _swiglu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, -1)
        dx = torch.empty_like(x)
        dgate, dup = dx.chunk(2, -1)
        torch.mul(grad, F.silu(gate), out=dup)
        torch.mul(grad, up, out=dgate)
        torch.ops.aten.silu_backward.grad_input(dgate, gate, grad_input=dgate)
        return dx


def swiglu(x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
    return SwiGLUFunction.apply(x)


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate).mul_(up)


def swiglu_again(x: torch.Tensor) -> tuple[torch.Tensor, Again | None]:
    """swiglu(x) for a linear layer's input, and how the layer computes it again from x (norm_again)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return swiglu(x), None
    return SwiGLUFunction.apply(x), Again(_swiglu, (x,))
