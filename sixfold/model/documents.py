"""Document masking (data.document_mask): a token attends only to earlier tokens of its own document.

A window of the token stream runs across documents, each closed by the end of text, which belongs to the document
it ends. Masks are additive (0 where a query sees a key, -inf where not) in the compute dtype, made once per
forward for every layer: attention saves the one tensor for backward. Rotary positions stay the window's: a score
depends only on the distance between two tokens, which a document's tokens keep wherever it starts.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .causal import ChunkedCausal, chunks_gain


def document_ids(tokens: torch.Tensor, eot: int) -> torch.Tensor:
    """Token ids [b, s] -> [b, s]: each token's document, counted from 0 along its row."""
    ends = (tokens == eot).long()
    return ends.cumsum(1) - ends


def visible(ids: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """bool [b, 1, len(q_pos), len(k_pos)]: the query at position q_pos[i] sees the key at k_pos[j] (same document,
    not later); `ids` [b, S] of the whole sequences, positions into them."""
    same = ids[:, q_pos, None] == ids[:, None, k_pos]
    return (same & (k_pos[None, :] <= q_pos[:, None]))[:, None]


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, -math.inf)


def within_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of q [b, hq, S, d] over k, v [b, hkv, S, d] within documents, `mask` additive [b, 1, S, S]. On a
    CPU in fp32 and fp64 in chunks of queries, each over its documents' keys (model/causal.py); in 16 bits the
    CPU's flash kernel with the causal flag beside the mask, which skips the tiles above the diagonal that SDPA
    given a mask computes (1.4 times causal attention's time at 2048 tokens); elsewhere SDPA with the mask."""
    if chunks_gain(q, masked=True):
        return ChunkedCausal.apply(q, k, v, mask)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=mask)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
