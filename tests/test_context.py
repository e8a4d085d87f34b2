"""Context parallelism's attention against plain attention on the whole sequence, and its balance.
Parity of whole runs is in test_parity.py."""
import json

import pytest

from sixfold.parallel.context import ContextParallel, _pairs
from helpers import torchrun


@pytest.mark.parametrize("cp", [2, 4])
def test_every_mode_equals_attention_on_the_whole_sequence(cp):
    """Forward and backward in fp64, ring / all-gather KV / Ulysses, zigzag and contiguous, MHA and GQA."""
    proc = torchrun("cp_attention.py", cp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("cp attention OK") == cp


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
    """At a fixed sequence length, ring and Ulysses within 15% of 1/cp of one process's bytes. All-gather KV
    is left out: every rank keeps the whole sequence's keys and values for backward."""
    out = tmp_path / "saved.json"
    proc = torchrun("cp_memory.py", cp, str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    for mode in ("ring", "ulysses"):
        for rank, nbytes in enumerate(saved[mode]):
            assert abs(nbytes * cp / saved["whole"] - 1) < 0.15, (mode, rank, nbytes * cp / saved["whole"])
