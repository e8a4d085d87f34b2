"""Causal attention on a CPU in chunks of queries.

PyTorch's CPU flash kernel skips keys above the diagonal only in whole blocks of 512, so up to about a thousand
tokens its causal attention costs as much as full attention. Here each chunk of 64 queries runs the kernel over
the keys up to its own end (the first chunk with the causal flag, the others with an additive causal mask, all
views of one [64, 2n] pattern), about half the work: at 256 tokens, 16 heads of 16, 4 sequences, 13 ms against 18
for forward and backward of a layer; at 2048, one sequence, 160 against 189.
Each chunk's softmax covers all the keys it sees, so its output is final: nothing is merged across chunks.
Given a mask, a chunk's keys are those its queries' rows reach: within documents they start at its first query's
document, so the work grows with the documents' length, not the sequence's (2048 tokens in documents of 100: 44 ms
against 249 for a layer's forward); under all-gather KV they end at its last query's position.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CHUNK = 64  # queries per kernel call
LONGEST = 2048  # beyond this the chunks' masks cost about what the kernel's own skipping of 512-key blocks leaves

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def chunks_gain(q: torch.Tensor, masked: bool = False) -> bool:
    """Whether attention of q [b, h, n, d] runs in chunks: on a CPU in fp32 or fp64 from 2 chunks' length, to
    LONGEST unless a mask bounds each chunk's keys (on a GPU the kernels skip the upper half themselves; in 16 bits
    the chunks' key gradients would be summed after rounding; under torch.compile the compiler chooses)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and \
        2 * CHUNK <= q.shape[2] and (masked or q.shape[2] <= LONGEST) and not torch.compiler.is_compiling()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [b, hq, s, d] over k, v [b, hkv, s, d]."""
    if chunks_gain(q):
        return ChunkedCausal.apply(q, k, v, None)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def _seen(mask: torch.Tensor, row: int) -> torch.Tensor:
    """bool [keys]: those the query `row` sees in any of the mask's rows of the batch."""
    return (mask[..., row, :] == 0).reshape(-1, mask.shape[-1]).any(0)


def _chunks(q: torch.Tensor, mask: torch.Tensor | None) -> list[tuple[int, int, int, int, torch.Tensor | None]]:
    """Each chunk of queries [a, e) with its keys [lo, hi) and its mask over them. Without a mask, queries and keys
    are the same tokens and hi = e: columns of one additive causal pattern [CHUNK, 2n], none for the first (the
    kernel's causal flag). A given mask [..., n, keys], queries and keys each in the order of their positions
    (causality, documents, also between two chunks of the ring), shows each query a range of keys whose ends do not
    fall from one query to the next, and once a query sees no key no later one does: lo is where the chunk's first
    query's range begins, hi where its last one's ends, over the batch's rows; lo = hi where its first query sees
    no key (nor do the others)."""
    n = q.shape[2]
    if mask is None:  # key j of chunk a, row i: column n - a + j, hidden where j - a > i
        hidden = torch.arange(-n, n, device=q.device)[None, :] > torch.arange(CHUNK, device=q.device)[:, None]
        pattern = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, -math.inf)
        return [(a, e, 0, e, None if a == 0 else pattern[:e - a, n - a:n - a + e])
                for a, e in ((a, min(a + CHUNK, n)) for a in range(0, n, CHUNK))]
    chunks = []
    for a in range(0, n, CHUNK):
        e, first = min(a + CHUNK, n), _seen(mask, a)
        if not first.any():
            chunks.append((a, e, 0, 0, None))
            continue
        lo, hi = int(first.int().argmax()), mask.shape[-1] - int(_seen(mask, e - 1).flip(0).int().argmax())
        chunks.append((a, e, lo, hi, mask[..., a:e, lo:hi]))
    return chunks


def chunked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The output, laid out [b, n, heads, d] (as the output projection reads it), and the log-sum-exp [b, heads, n]
    of attention of q [b, heads, n, d]: causal (mask None, keys the queries' tokens), or under an additive mask
    [b, 1, n, keys] as _chunks says (model/documents.py, all-gather KV's, the ring's pairs). Queries that see no
    key: output 0, log-sum-exp -inf (where a chunk's first one sees none)."""
    b, h, n, d = q.shape
    out = q.new_empty(b, n, h, d).transpose(1, 2)
    lse = []
    for a, e, lo, hi, m in _chunks(q, mask):
        if lo == hi:
            out[:, :, a:e] = 0
            lse.append(q.new_full((b, h, e - a), -math.inf))
            continue
        o, l = _forward(q[:, :, a:e], k[:, :, lo:hi], v[:, :, lo:hi], 0.0, m is None, attn_mask=m, scale=scale)[:2]
        out[:, :, a:e] = o
        lse.append(l)
    return out, torch.cat(lse, 2)


def chunked_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, mask: torch.Tensor | None = None, scale: float | None = None):
    """dq, dk, dv from chunked_forward's output and log-sum-exp."""
    b, h, n, d = q.shape
    dq = q.new_empty(b, n, h, d).transpose(1, 2)
    dk = dv = None
    for a, e, lo, hi, m in reversed(_chunks(q, mask)):
        if lo == hi:
            dq[:, :, a:e] = 0
            continue
        gq, gk, gv = _backward(grad[:, :, a:e], q[:, :, a:e], k[:, :, lo:hi], v[:, :, lo:hi], out[:, :, a:e],
                               lse[:, :, a:e], 0.0, m is None, attn_mask=m, scale=scale)
        dq[:, :, a:e] = gq
        if dk is None and hi - lo == k.shape[2]:  # the last chunk under causality alone: dk and dv start there
            dk, dv = gk, gv
            continue
        if dk is None:
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dk[:, :, lo:hi] += gk
        dv[:, :, lo:hi] += gv
    return (dq, dk, dv) if dk is not None else (dq, torch.zeros_like(k), torch.zeros_like(v))


def _in_chunks(q: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> bool:
    """Whether cpu_forward and cpu_backward run in chunks: attention causal or masked (the mask as _chunks says;
    causal, it keeps causality itself), where chunks gain."""
    return (causal or mask is not None) and chunks_gain(q, masked=mask is not None)


def cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None = None,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's output and log-sum-exp, for a caller that writes its own backward (cpu_backward): in
    chunks where _in_chunks says, else the whole kernel."""
    if _in_chunks(q, causal, mask):
        return chunked_forward(q, k, v, mask, scale)
    return _forward(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]


def cpu_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, mask: torch.Tensor | None = None, scale: float | None = None):
    """dq, dk, dv of cpu_forward."""
    if _in_chunks(q, causal, mask):
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
