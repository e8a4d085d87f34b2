"""Causal attention in chunks of queries on a CPU (model/causal.py) against SDPA's whole kernel: gradients against
finite differences in fp64, output and gradients in fp32 (causal, and within documents), a ring's masked pair of
chunks, the same bytes saved for backward, SDPA where chunks would not gain, and each chunk's mask (model/visible.py)
against the whole mask."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sixfold.activations import SavedTensors
from sixfold.model.causal import (CHUNK, LONGEST, ChunkedCausal, _backward, _forward, causal_attention, cpu_backward,
                                  cpu_forward)
from sixfold.model.documents import document_ids, within_documents
from sixfold.model.visible import Visible


def _heads(b: int, s: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """One buffer [b, s, heads, d] of q, k and v heads, as the model lays them out."""
    return torch.randn(b, s, hq + 2 * hkv, d, dtype=dtype, requires_grad=True)


def _split(x: torch.Tensor, hq: int, hkv: int):
    return x.transpose(1, 2).split([hq, hkv, hkv], 1)


def _document_mask(ends: list[list[int]], s: int, dtype: torch.dtype) -> Visible:
    """What the queries of rows whose documents end at the given positions (an end of text, 0) see."""
    tokens = torch.ones(len(ends), s, dtype=torch.long)
    for row, at in enumerate(ends):
        tokens[row, at] = 0
    whole = torch.arange(s)
    return Visible(document_ids(tokens, 0), whole, whole, dtype)


@pytest.mark.parametrize("ends", [None, [[CHUNK + 10]]])
def test_gradients_match_finite_differences_with_a_short_last_chunk(ends):
    """Causal, and within documents: the second chunk's keys start at its first query's document."""
    torch.manual_seed(0)
    s = 2 * CHUNK + 2
    x = _heads(1, s, 2, 1, 4, torch.float64)
    mask = None if ends is None else _document_mask(ends, s, torch.float64)
    assert torch.autograd.gradcheck(lambda x: ChunkedCausal.apply(*_split(x, 2, 1), mask), (x,))


def _assert_equal_to_round_off(ours, reference, x: torch.Tensor, hq: int, hkv: int) -> None:
    """ours(q, k, v) runs in chunks and equals reference(q, k, v) in output and gradients to fp32 round-off."""
    grad = torch.randn(x.shape[0], hq, x.shape[1], x.shape[3])
    outs, grads = [], []
    for attend in (ours, reference):
        x.grad = None
        out = attend(*_split(x, hq, hkv))
        out.backward(grad)
        outs.append(out)
        grads.append(x.grad)
    assert type(outs[0].grad_fn).__name__ == "ChunkedCausalBackward"
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=2e-6)
    assert torch.allclose(grads[0], grads[1], rtol=0, atol=1e-5)
    assert outs[0].transpose(1, 2).is_contiguous()  # the output projection reads it without a copy


@pytest.mark.parametrize("s, hq, hkv", [(256, 16, 16), (300, 8, 2)])
def test_output_and_gradients_equal_the_whole_kernel_to_round_off(s, hq, hkv):
    torch.manual_seed(0)
    _assert_equal_to_round_off(causal_attention, lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=hq != hkv), _heads(2, s, hq, hkv, 16, torch.float32), hq, hkv)


@pytest.mark.parametrize("s", [3 * CHUNK + 10, LONGEST + CHUNK])
def test_within_documents_equals_sdpa_given_the_mask(s):
    """Chunks at any length within documents; the keys of the chunks from the third on start past 0."""
    torch.manual_seed(0)
    mask = _document_mask([[30, 100, 190], [64, 65]], s, torch.float32)
    _assert_equal_to_round_off(lambda q, k, v: within_documents(q, k, v, mask), lambda q, k, v:
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), enable_gqa=True),
                               _heads(2, s, 4, 2, 16, torch.float32), 4, 2)


def test_a_masked_pair_of_chunks_equals_the_whole_kernel_on_the_queries_that_see_keys():
    """Keys at positions 0-255, queries at 256-511 (as in a ring's pair): one document crosses from the keys into
    the first 45 queries; the chunks from the second on see no key and are skipped."""
    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 256, 8, dtype=torch.float64) for _ in range(4))
    ids = (torch.arange(512) >= 200).long() + (torch.arange(512) > 300).long() + (torch.arange(512) > 400).long()
    mask = Visible(ids.expand(2, -1), torch.arange(256, 512), torch.arange(256), torch.float64)
    seeing = slice(0, 45)
    out, lse = cpu_forward(q, k, v, False, mask)
    whole_out, whole_lse = _forward(q, k, v, 0.0, False, attn_mask=mask.dense())[:2]
    assert torch.allclose(out[:, :, seeing], whole_out[:, :, seeing], rtol=0, atol=1e-12)
    assert torch.allclose(lse[:, :, seeing], whole_lse[:, :, seeing], rtol=0, atol=1e-12)
    assert (out[:, :, CHUNK:] == 0).all() and (lse[:, :, CHUNK:] == -math.inf).all()
    lse = lse.clone()
    lse[:, :, 45:] = 0.0  # (a ring merges in the log-sum-exp of pairs where these queries see keys)
    ours = cpu_backward(grad, q, k, v, out, lse, False, mask)
    whole = _backward(grad, q, k, v, out, lse, 0.0, False, attn_mask=mask.dense())
    for a, b in zip(ours, whole):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_saves_what_the_whole_kernel_saves():
    x = _heads(2, 256, 4, 2, 16, torch.float32)
    nbytes = []
    for attend in (causal_attention, lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True)):
        with SavedTensors(nn.Module()) as saved:
            attend(*_split(x, 4, 2))
        nbytes.append(saved.nbytes)
    assert nbytes[0] == nbytes[1]


@pytest.mark.parametrize("s, dtype, chunked", [
    (2 * CHUNK, torch.float32, True), (LONGEST, torch.float64, True), (2 * CHUNK - 1, torch.float32, False),
    (LONGEST + 1, torch.float32, False), (256, torch.bfloat16, False)])
def test_chunks_only_where_they_gain(s, dtype, chunked):
    out = causal_attention(*_split(_heads(1, s, 2, 2, 8, dtype), 2, 2))
    assert (type(out.grad_fn).__name__ == "ChunkedCausalBackward") == chunked


@pytest.mark.parametrize("documents", [False, True])
def test_each_chunks_mask_is_its_part_of_the_whole_mask(documents):
    """Visible's blocks (views of one pattern by causality alone over consecutive positions) equal the slices of its
    whole mask, which has a storage of its own; each query's range of keys is where its row of the whole mask is
    0. Queries at zigzag-like positions (two runs) over keys at every position."""
    ids = document_ids((torch.rand(2, 320, generator=torch.Generator().manual_seed(0)) < 0.03).long(), 1)
    q_pos, k_pos = torch.cat([torch.arange(40, 120), torch.arange(200, 280)]), torch.arange(320)
    mask = Visible(ids if documents else None, q_pos, k_pos, torch.float32)
    whole = mask.dense()
    assert whole.untyped_storage().nbytes() == whole.numel() * 4
    expected = k_pos <= q_pos[:, None]
    if documents:
        expected = (expected & (ids[:, q_pos, None] == ids[:, None, k_pos]))[:, None]
    assert torch.equal(whole == 0, expected)
    for a, e, lo, hi in [(0, 64, 0, 120), (64, 128, 30, 250), (100, 160, 0, 320), (150, 160, 190, 280)]:
        assert torch.equal(mask.block(a, e, lo, hi), whole[..., a:e, lo:hi])
    start, end = mask.ranges()
    cols = torch.arange(320)
    assert torch.equal((cols >= start[..., None]) & (cols < end[..., None]), (whole == 0).reshape(-1, 160, 320))
