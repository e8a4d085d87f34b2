"""The output head and the cross-entropy fused over chunks of tokens: full-vocabulary logits exist for one chunk
at a time, never for the whole micro-batch.

Forward computes each chunk's logits, its losses and at once its gradients (softmax minus the one-hot target),
so backward only scales them by the incoming gradient and nothing runs twice. What stays alive from forward to
backward is the gradient of the head's input ([tokens, dim]) and of its weight (fp32, the weight's shape), which
each chunk's product adds to in place. On a GPU the per-chunk softmax work is compiled into two passes over the
logits.
"""
from __future__ import annotations

import torch

from ..parallel.tensor import IGNORE_INDEX


def _losses_and_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy (in fp32 or wider) of logits [n, vocab] and its gradient in the logits' dtype."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = x.logsumexp(-1)
    keep = labels != IGNORE_INDEX
    target = labels.masked_fill(~keep, 0)[:, None]
    loss = ((lse - x.gather(1, target)[:, 0]) * keep).sum()
    hit = torch.arange(x.shape[1], device=x.device)[None, :] == target
    grad = ((x - lse[:, None]).exp() - hit.to(x.dtype)) * keep[:, None]
    return loss, grad.to(logits.dtype)


def _scaled(dw: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (dw * grad).to(dtype)


_compiled = {}


def _fast(fn, *args):
    """fn compiled on a GPU (one pass over memory where eager takes several), eager elsewhere."""
    if not args[0].is_cuda:
        return fn(*args)
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn](*args)


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b inside the matrix product, in acc's precision (bf16 products into fp32 on a GPU)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(a @ b)


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk: int):
        wide = torch.promote_types(h.dtype, torch.float32)
        loss = torch.zeros((), dtype=wide, device=h.device)
        dh = torch.empty_like(h)
        dw = torch.zeros(weight.shape, dtype=wide, device=weight.device)
        for start in range(0, h.shape[0], chunk):
            x = h[start:start + chunk]
            part, grad = _fast(_losses_and_grad, x @ weight.t(), labels[start:start + chunk])
            loss += part
            torch.mm(grad, weight, out=dh[start:start + chunk])
            _add_product(dw, grad.t(), x)
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        return dh * grad.to(dh.dtype), _fast(_scaled, dw, grad, ctx.weight_dtype), None, None


def chunked_head_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sum of token cross-entropies (fp32) of logits h @ weight.T; h [tokens, dim], labels [tokens]."""
    return _ChunkedHeadLoss.apply(h, weight, labels, chunk)
