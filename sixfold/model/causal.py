"""Causal attention on a CPU in chunks of queries.

PyTorch's CPU flash kernel skips keys above the diagonal only in whole blocks of 512, so up to about a thousand
tokens its causal attention costs as much as full attention. Here each chunk of 64 queries runs the kernel over
the keys up to its own end (with an additive causal mask, a view of one [64, 2n] pattern: model/visible.py), about
half the work: at 256 tokens, 16 heads of 16, 4 sequences, 13 ms against 18 for forward and backward of a layer;
at 2048, one sequence, 160 against 189.
Each chunk's softmax covers all the keys it sees, so its output is final: nothing is merged across chunks.
Given a mask, a chunk's keys are those its queries' rows reach: within documents they start at its first query's
document, so the work grows with the documents' length, not the sequence's (2048 tokens in documents of 100: 44 ms
against 249 for a layer's forward); under all-gather KV they end at its last query's position. Each chunk's mask is
made as it runs, from the positions and document ids: no mask of the whole sequence exists.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .visible import PATTERN_ROWS, Visible

CHUNK = PATTERN_ROWS  # queries per kernel call: each one's causal mask a view of one pattern
LONGEST = 2048  # beyond this the chunks' masks cost about what the kernel's own skipping of 512-key blocks leaves

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def chunks_gain(q: torch.Tensor, masked: bool = False) -> bool:
    """Whether attention of q [b, h, n, d] runs in chunks: where in_chunks says, unless under torch.compile (the
    compiler chooses)."""
    return in_chunks(q.device.type, q.dtype, q.shape[2], masked) and not torch.compiler.is_compiling()


def in_chunks(device: str, dtype: torch.dtype, n: int, masked: bool) -> bool:
    """Whether eager attention of n queries runs in chunks (the planner asks it too): on a CPU in fp32 or fp64 from 2
    chunks' length, to LONGEST unless a mask bounds each chunk's keys (on a GPU the kernels skip the upper half
    themselves; in 16 bits the chunks' key gradients would be summed after rounding)."""
    return device == "cpu" and dtype in (torch.float32, torch.float64) and 2 * CHUNK <= n and \
        (masked or n <= LONGEST)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [b, hq, s, d] over k, v [b, hkv, s, d]."""
    if chunks_gain(q):
        return ChunkedCausal.apply(q, k, v, None)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def _chunks(q: torch.Tensor, mask: Visible | None) -> tuple[Visible, list[tuple[int, int, int, int]]]:
    """The mask (causal, for None) and each chunk of queries [a, e) with the keys [lo, hi) its queries see over the
    batch's rows (the mask's ranges; causal: those up to its end); lo = hi where none of them sees a key."""
    n = q.shape[2]
    if mask is None:
        whole = torch.arange(n, device=q.device)
        return Visible(None, whole, whole, q.dtype), [(a, min(a + CHUNK, n), 0, min(a + CHUNK, n))
                                                      for a in range(0, n, CHUNK)]
    pad, keys = -n % CHUNK, len(mask.k_pos)
    start, end = mask.ranges()
    live = end > start
    lo = F.pad(start.masked_fill(~live, keys), (0, pad), value=keys).view(start.shape[0], -1, CHUNK).amin((0, 2))
    hi = F.pad(end.masked_fill(~live, 0), (0, pad)).view(end.shape[0], -1, CHUNK).amax((0, 2))
    spans = zip(range(0, n, CHUNK), lo.tolist(), hi.tolist())
    return mask, [(a, min(a + CHUNK, n), *((l, h) if l < h else (0, 0))) for a, l, h in spans]


def chunked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Visible | None = None,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The output, laid out [b, n, heads, d] (as the output projection reads it), and the log-sum-exp [b, heads, n]
    of attention of q [b, heads, n, d]: causal (mask None, keys the queries' tokens), or as `mask` says (model/
    visible.py: within documents, all-gather KV's, the ring's pairs), each chunk's mask made from it. Queries that
    see no key: output 0, log-sum-exp -inf (where none of a chunk's queries sees one)."""
    b, h, n, d = q.shape
    out = q.new_empty(b, n, h, d).transpose(1, 2)
    lse = []
    mask, chunks = _chunks(q, mask)
    for a, e, lo, hi in chunks:
        if lo == hi:
            out[:, :, a:e] = 0
            lse.append(q.new_full((b, h, e - a), -math.inf))
            continue
        o, l = _forward(q[:, :, a:e], k[:, :, lo:hi], v[:, :, lo:hi], 0.0, False, attn_mask=mask.block(a, e, lo, hi),
                        scale=scale)[:2]
        out[:, :, a:e] = o
        lse.append(l)
    return out, torch.cat(lse, 2)


def chunked_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, mask: Visible | None = None, scale: float | None = None):
    """dq, dk, dv from chunked_forward's output and log-sum-exp."""
    b, h, n, d = q.shape
    dq = q.new_empty(b, n, h, d).transpose(1, 2)
    dk = dv = None
    mask, chunks = _chunks(q, mask)
    for a, e, lo, hi in reversed(chunks):
        if lo == hi:
            dq[:, :, a:e] = 0
            continue
        gq, gk, gv = _backward(grad[:, :, a:e], q[:, :, a:e], k[:, :, lo:hi], v[:, :, lo:hi], out[:, :, a:e],
                               lse[:, :, a:e], 0.0, False, attn_mask=mask.block(a, e, lo, hi), scale=scale)
        dq[:, :, a:e] = gq
        if dk is None and hi - lo == k.shape[2]:  # the last chunk under causality alone: dk and dv start there
            dk, dv = gk, gv
            continue
        if dk is None:
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dk[:, :, lo:hi] += gk
        dv[:, :, lo:hi] += gv
    return (dq, dk, dv) if dk is not None else (dq, torch.zeros_like(k), torch.zeros_like(v))


def _in_chunks(q: torch.Tensor, causal: bool, mask: Visible | None) -> bool:
    """Whether cpu_forward and cpu_backward run in chunks: attention causal or masked (the mask as _chunks says;
    causal, it keeps causality itself), where chunks gain."""
    return (causal or mask is not None) and chunks_gain(q, masked=mask is not None)


def cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: Visible | None = None,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's output and log-sum-exp, for a caller that writes its own backward (cpu_backward): in
    chunks where _in_chunks says, else the whole kernel (with the whole mask)."""
    if _in_chunks(q, causal, mask):
        return chunked_forward(q, k, v, mask, scale)
    return _forward(q, k, v, 0.0, causal, attn_mask=_dense(mask), scale=scale)[:2]


def cpu_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, mask: Visible | None = None, scale: float | None = None):
    """dq, dk, dv of cpu_forward."""
    if _in_chunks(q, causal, mask):
        return chunked_backward(grad, q, k, v, out, lse, mask, scale)
    return _backward(grad, q, k, v, out, lse, 0.0, causal, attn_mask=_dense(mask), scale=scale)


def _dense(mask: Visible | None) -> torch.Tensor | None:
    return None if mask is None else mask.dense()


class ChunkedCausal(torch.autograd.Function):
    """chunked_forward as a Function. Saves q, k, v, the output (the output projection's input too) and the
    log-sum-exp, as the whole kernel saves them, and keeps the mask's positions and ids: no whole mask."""

    @staticmethod
    def forward(ctx, q, k, v, mask: Visible | None):
        out, lse = chunked_forward(q, k, v, mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask = mask
        return out

    @staticmethod
    def backward(ctx, grad):
        return *chunked_backward(grad, *ctx.saved_tensors, ctx.mask), None
