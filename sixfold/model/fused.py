"""RMSNorm, rotary embedding and SwiGLU as autograd Functions with hand-written backward.

Autograd's chain of small operations makes several passes over memory and saves their intermediates; these make
fewer passes and save only their input (the norm: and its per-token statistics) or nothing (rotation: the tables).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNormFunction(torch.autograd.Function):
    """weight * (x / rms(x)).to(x.dtype), the statistics in fp32 or wider (Hugging Face's LlamaRMSNorm)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        h = x.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        y = (h * rstd).to(x.dtype)
        return y.mul_(weight) if weight.dtype == y.dtype else weight * y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g = grad.float()
        dweight = (g * xhat).flatten(0, -2).sum(0).to(weight.dtype)
        gy = g * weight.float()
        # d/dx of x * rstd(x): rstd * (gy - xhat * mean(gy * xhat))
        mean = (gy * xhat).mean(-1, keepdim=True)
        dx = gy.sub_(xhat.mul_(mean)).mul_(rstd)
        return dx.to(x.dtype), dweight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """Each head's halves (x1, x2) turned by the angle (sign +1) or back (-1): (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-sign)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin, value=sign)
    return out


class RotaryFunction(torch.autograd.Function):
    """Rotate-half rotary embedding; its gradient is the inverse rotation, so nothing but the tables is saved."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0), None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., s, heads, head_dim] rotated by the angles of its s positions; cos, sin [s, 1, head_dim / 2]."""
    return RotaryFunction.apply(x, cos, sin)


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up from x = [gate | up] (one product of the stacked weights); the gradient comes out as one
    tensor of x's layout, and silu(gate) is computed again in backward rather than saved."""

    @staticmethod
    def forward(ctx, x):
        gate, up = x.chunk(2, -1)
        ctx.save_for_backward(x)
        return F.silu(gate).mul_(up)

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
    return SwiGLUFunction.apply(x)
