"""Causal attention on a CPU in chunks of queries.

PyTorch's CPU flash kernel skips keys above the diagonal only in whole blocks of 512, so up to about a thousand
tokens its causal attention costs as much as full attention. Here each chunk of 64 queries runs the kernel over
the keys up to its own end (the first chunk with the causal flag, the others with the causal mask's rows), about
half the work: at 256 tokens, 16 heads of 16, 4 sequences, 13 ms against 18 for forward and backward of a layer.
Each chunk's softmax covers all the keys it sees, so its output is final: nothing is merged across chunks.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CHUNK = 64  # queries per kernel call
LONGEST = 1024  # beyond this the kernel's own skipping of 512-key blocks leaves little to gain

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def chunks_gain(q: torch.Tensor) -> bool:
    """Whether attention of q [b, h, s, d] runs in chunks: on a CPU in fp32 or fp64 from 2 chunks' length to
    LONGEST (on a GPU the kernels skip the upper half themselves; in 16 bits the chunks' key gradients would be
    summed after rounding; under torch.compile the compiler chooses)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and \
        2 * CHUNK <= q.shape[2] <= LONGEST and not torch.compiler.is_compiling()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [b, hq, s, d] over k, v [b, hkv, s, d]."""
    if chunks_gain(q):
        return ChunkedCausal.apply(q, k, v, None)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def _chunks(q: torch.Tensor, mask: torch.Tensor | None) -> list[tuple[int, int, torch.Tensor | None]]:
    """Each chunk of queries [a, e) with its mask over the keys [0, e): rows of the given mask or of an additive
    causal one, none for the first under causality alone (the kernel's causal flag)."""
    s = q.shape[2]
    rows = torch.full((s, s), -math.inf, dtype=q.dtype, device=q.device).triu_(1) if mask is None else mask
    return [(a, min(a + CHUNK, s), None if mask is None and a == 0 else rows[..., a:a + CHUNK, :a + CHUNK])
            for a in range(0, s, CHUNK)]


def chunked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The output, laid out [b, s, heads, d] (as the output projection reads it), and the log-sum-exp [b, heads, s]
    of causal attention: mask None, or additive [b, 1, s, s] that keeps causality itself (model/documents.py)."""
    b, h, s, d = q.shape
    out = q.new_empty(b, s, h, d).transpose(1, 2)
    lse = []
    for a, e, m in _chunks(q, mask):
        o, l = _forward(q[:, :, a:e], k[:, :, :e], v[:, :, :e], 0.0, a == 0, attn_mask=m, scale=scale)[:2]
        out[:, :, a:e] = o
        lse.append(l)
    return out, torch.cat(lse, 2)


def chunked_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None):
    """dq, dk, dv from chunked_forward's output and log-sum-exp."""
    b, h, s, d = q.shape
    dq = q.new_empty(b, s, h, d).transpose(1, 2)
    dk = dv = None
    for a, e, m in reversed(_chunks(q, mask)):  # the last chunk sees every key: dk, dv start there
        gq, gk, gv = _backward(grad[:, :, a:e], q[:, :, a:e], k[:, :, :e], v[:, :, :e], out[:, :, a:e],
                               lse[:, :, a:e], 0.0, a == 0, attn_mask=m, scale=scale)
        dq[:, :, a:e] = gq
        if dk is None:
            dk, dv = gk, gv
        else:
            dk[:, :, :e] += gk
            dv[:, :, :e] += gv
    return dq, dk, dv


def cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None = None,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's output and log-sum-exp, for a caller that writes its own backward (cpu_backward): in
    chunks where attention is causal and chunks gain (a causal `mask` keeps causality itself), else the whole
    kernel."""
    if causal and chunks_gain(q):
        return chunked_forward(q, k, v, mask, scale)
    return _forward(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]


def cpu_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, mask: torch.Tensor | None = None, scale: float | None = None):
    """dq, dk, dv of cpu_forward."""
    if causal and chunks_gain(q):
        return chunked_backward(grad, q, k, v, out, lse, mask, scale)
    return _backward(grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


class ChunkedCausal(torch.autograd.Function):
    """chunked_forward as a Function. Saves q, k, v, the mask, the output (the output projection's input too) and
    the log-sum-exp, as the whole kernel saves them."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out, lse = chunked_forward(q, k, v, mask)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        return *chunked_backward(grad, *ctx.saved_tensors), None
