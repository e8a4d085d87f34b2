"""Document masking (data.document_mask): a token attends only to earlier tokens of its own document.

A window of the token stream runs across documents, each closed by the end of text, which belongs to the document
it ends. Which keys a query sees is kept as the document ids and positions of both (Visible), made once per forward
for every layer; masks are made from them: on a CPU a chunk of queries' at a time, over the keys it reaches (model/
causal.py), else one additive mask of them all (0 where a query sees a key, -inf where not) in the compute dtype,
made once and shared by every layer's attention, which saves it for backward. Rotary positions stay the window's:
a score depends only on the distance between two tokens, which a document's tokens keep wherever it starts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .causal import ChunkedCausal, chunks_gain
from .visible import Visible


def document_ids(tokens: torch.Tensor, eot: int) -> torch.Tensor:
    """Token ids [b, s] -> [b, s]: each token's document, counted from 0 along its row."""
    ends = (tokens == eot).long()
    return ends.cumsum(1) - ends


def within_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Visible) -> torch.Tensor:
    """Attention of q [b, hq, S, d] over k, v [b, hkv, S, d] within documents. On a CPU in fp32 and fp64 in chunks
    of queries, each over its documents' keys (model/causal.py); in 16 bits the CPU's flash kernel with the causal
    flag beside the whole mask, which skips the tiles above the diagonal that SDPA given a mask computes (1.4 times
    causal attention's time at 2048 tokens); elsewhere SDPA with the whole mask."""
    if chunks_gain(q, masked=True):
        return ChunkedCausal.apply(q, k, v, mask)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=mask.dense())[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), enable_gqa=k.shape[1] != q.shape[1])
