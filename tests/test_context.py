"""Context parallelism's attention against plain attention on the whole sequence, and its balance.
Parity of whole runs is in test_parity.py."""
import json

import pytest
import torch
import torch.nn.functional as F

from sixfold.config import load_config
from sixfold.parallel import context
from sixfold.model.documents import document_ids
from sixfold.model.visible import Visible
from sixfold.parallel.context import ContextParallel, _Ring, _pairs, ring_masks
from helpers import TINY, torchrun


@pytest.mark.parametrize("cp", [2, 4])
def test_every_mode_equals_attention_on_the_whole_sequence(cp):
    """Forward and backward in fp64, ring / all-gather KV / Ulysses, zigzag and contiguous, MHA and GQA."""
    proc = torchrun("cp_attention.py", cp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("cp attention OK") == cp


def relative_errors(attend, dtype, device, heads: int, kv_heads: int, seq: int = 256, head_dim: int = 64,
                    ids=None):
    """Output, dq, dk, dv of attend(q, k, v) in `dtype` against SDPA on the whole sequence in fp64 (within the
    documents `ids` [b, seq], if given)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, seq, head_dim, device=device) for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(2, heads, seq, head_dim, device=device)
    ours = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
    out = attend(*ours)
    out.backward(dout.to(dtype))
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    whole = torch.arange(seq, device=device)
    mask = None if ids is None else Visible(ids, whole, whole, torch.float64).dense() == 0
    expected = F.scaled_dot_product_attention(*ref, attn_mask=mask, is_causal=ids is None,
                                              enable_gqa=heads != kv_heads)
    expected.backward(dout.double())
    pairs = [(out, expected)] + [(a.grad, b.grad) for a, b in zip(ours, ref)]
    return [float((a.double() - b).norm() / b.norm()) for a, b in ((a.detach(), b.detach()) for a, b in pairs)]


def ring(q, k, v):
    """The ring's blocks and merge on one rank holding the whole sequence as two zigzag chunks (chunk 1 attends
    to chunk 0 and, causally, to itself)."""
    return _Ring.apply(q, k, v, ContextParallel(), None)


def math_kernels(q, masked=False):
    return context._math_forward, context._math_backward


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("kernels", ["cpu", "math"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_ring_blocks_and_merge_in_one_process(heads, kv_heads, kernels, monkeypatch):
    """The CPU's flash-attention kernels and the blockwise math path (a GPU's in fp32) in fp64: output, dq, dk, dv
    to round-off."""
    if kernels == "math":
        monkeypatch.setattr(context, "_kernels", math_kernels)
    assert max(relative_errors(ring, torch.float64, "cpu", heads, kv_heads)) < 1e-12


@pytest.mark.parametrize("kernels", ["cpu", "math"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_the_ring_keeps_each_token_to_its_document(heads, kv_heads, kernels, monkeypatch):
    """Document masks on the ring's blocks in fp64: a document ending in the first chunk, one starting in the second
    (its first queries see no key of the first chunk), one of a single token; a row of one document (no mask
    needed); output, dq, dk, dv to round-off."""
    if kernels == "math":
        monkeypatch.setattr(context, "_kernels", math_kernels)
    tokens = torch.ones(2, 256, dtype=torch.long)
    tokens[0, [40, 127, 128, 200]] = 0
    ids = document_ids(tokens, 0)
    masks = ring_masks(ContextParallel(), ids, torch.float64)
    assert set(masks) == {(0, 0), (1, 0), (1, 1)} and all(m is not None for m, _ in masks.values())
    def attend(q, k, v):
        return _Ring.apply(q, k, v, ContextParallel(), masks)

    assert max(relative_errors(attend, torch.float64, "cpu", heads, kv_heads, ids=ids)) < 1e-12
    whole_rows = document_ids(torch.ones(2, 256, dtype=torch.long), 0)
    assert all(m == (None, None) for m in ring_masks(ContextParallel(), whole_rows, torch.float64).values())


@pytest.mark.parametrize("zigzag", [True, False])
def test_the_ring_keeps_exactly_the_chunk_pairs_in_which_a_query_sees_a_key(zigzag):
    """ring_masks decides from the documents of each chunk's first and last token: against each pair's whole
    visibility, over random documents (short to longer than a row), on every rank of cp 2, 3 and 4."""
    gen = torch.Generator().manual_seed(0)
    for size in (2, 3, 4):
        for rate in (0.01, 0.05, 0.2, 0.6):
            ids = document_ids((torch.rand(3, 48 * size, generator=gen) < rate).long(), 1)
            for rank in range(size):
                cp = FakeRank(size, rank, zigzag)
                n = ids.shape[1] // cp.n_chunks
                span, usual = torch.arange(n), torch.ones(n, n, dtype=torch.bool)
                masks = ring_masks(cp, ids, torch.float64)
                for a in cp.chunks:
                    for c in range(a + 1):
                        seen = Visible(ids, span + a * n, span + c * n, torch.float64).dense() == 0
                        if not seen.any():
                            assert (a, c) not in masks
                        elif (seen == (usual.tril() if a == c else usual)).all():
                            assert masks[a, c] == (None, None)
                        else:
                            mask, empty = masks[a, c]
                            assert torch.equal(mask.dense() == 0, seen)
                            assert torch.equal(empty, ~seen.any(-1)[:, :, None])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_ring_in_bf16_on_a_cpu_is_as_close_as_fused_attention(heads, kv_heads):
    """The CPU's flash-attention kernels (bf16) inside the ring: output and gradients as close to fp64 as fused
    SDPA's on the whole sequence in bf16 (within twice its error)."""
    ours, fused = (relative_errors(f, torch.bfloat16, "cpu", heads, kv_heads) for f in (ring, sdpa))
    assert all(a < 2 * b for a, b in zip(ours, fused)), (ours, fused)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel runs on a GPU")
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_ring_with_the_flash_kernel_on_a_gpu(heads, kv_heads):
    """The flash-attention kernels (bf16) inside the ring: output and gradients as close to fp64 as fused SDPA's
    on the whole sequence in bf16 (within twice its error)."""
    ours, fused = (relative_errors(f, torch.bfloat16, "cuda", heads, kv_heads) for f in (ring, sdpa))
    assert all(a < 2 * b for a, b in zip(ours, fused)), (ours, fused)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel runs on a GPU")
def test_the_ring_within_documents_on_a_gpu():
    """Masked chunk pairs on the einsum path in fp32, the others on the flash kernels (bf16): output and gradients as
    close to fp64 as SDPA's with the mask on the whole sequence in bf16 (within twice its error)."""
    tokens = torch.ones(2, 256, dtype=torch.long, device="cuda")
    tokens[0, [40, 127, 128, 200]] = 0
    ids = document_ids(tokens, 0)
    masks = ring_masks(ContextParallel(), ids, torch.bfloat16)

    def attend(q, k, v):
        return _Ring.apply(q, k, v, ContextParallel(), masks)

    def fused(q, k, v):
        whole = torch.arange(256, device="cuda")
        seen = Visible(ids, whole, whole, torch.float64).dense() == 0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=True)

    ours, theirs = (relative_errors(f, torch.bfloat16, "cuda", 8, 2, ids=ids) for f in (attend, fused))
    assert all(a < 2 * b for a, b in zip(ours, theirs)), (ours, theirs)


class FakeRank(ContextParallel):
    def __init__(self, size: int, rank: int, zigzag: bool):
        super().__init__(zigzag=zigzag)
        self.size, self.rank, self.n_chunks = size, rank, 2 * size if zigzag else size


def ring_work(size: int, rank: int, zigzag: bool) -> float:
    """Attention work of a rank over the whole ring, in chunk-pair areas (a causal diagonal pair counts half)."""
    cp = FakeRank(size, rank, zigzag)
    area = (1 / cp.n_chunks) ** 2
    return sum(area / 2 if causal else area for owner in range(size) for _, _, causal in _pairs(cp, owner))


@pytest.mark.parametrize("size", [2, 4, 8])
def test_zigzag_balances_the_causal_work_and_contiguous_does_not(size):
    zigzag = [ring_work(size, r, True) for r in range(size)]
    contiguous = [ring_work(size, r, False) for r in range(size)]
    assert max(zigzag) - min(zigzag) < 1e-12 and abs(sum(zigzag) - 0.5) < 1e-12
    assert abs(sum(contiguous) - 0.5) < 1e-12 and max(contiguous) / min(contiguous) == 2 * size - 1


@pytest.mark.parametrize("cp", [2, 4])
def test_saved_activations_per_rank_fall_as_one_over_cp(cp, tmp_path):
    """At a fixed sequence length, ring within 3% of 1/cp of one process's bytes, and Ulysses too beside its two
    copies: the attention output at the other split (its rank's tokens, every head: wo's input) and the kv heads
    repeated up to cp where there are fewer. All-gather KV is left out: every rank keeps the whole sequence's keys
    and values for backward."""
    out = tmp_path / "saved.json"
    proc = torchrun("cp_memory.py", cp, str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    m = load_config(TINY).model
    tokens = 2 * 64 // cp  # cp_memory.py's batch, this rank's share
    copies = 4 * m.n_layers * tokens * m.head_dim * (m.n_heads + 2 * m.n_kv_heads * (max(1, cp // m.n_kv_heads) - 1))
    for mode, extra in (("ring", 0), ("ulysses", copies)):
        for rank, nbytes in enumerate(saved[mode]):
            share = (nbytes - extra) * cp / saved["whole"]
            assert abs(share - 1) < 0.03, (mode, rank, share)
