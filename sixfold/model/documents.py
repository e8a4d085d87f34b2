"""Document masking (data.document_mask): a token attends only to earlier tokens of its own document.

A window of the token stream runs across documents, each closed by the end of text, which belongs to the document
it ends. Masks are additive (0 where a query sees a key, -inf where not) in the compute dtype, made once per
forward for every layer: attention saves the one tensor for backward. Rotary positions stay the window's: a score
depends only on the distance between two tokens, which a document's tokens keep wherever it starts.
"""
from __future__ import annotations

import math

import torch


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
