"""Which keys each query of an attention sees, kept as positions (and document ids) rather than a mask [n, m]:
masks are made from them for a block of queries and keys at a time, or once for all."""
from __future__ import annotations

import math

import torch

PATTERN_ROWS = 64  # the most queries in a block that a view of the causal pattern serves (model/causal.py's chunks)


class Visible:
    """Which keys each query sees: those not later than it and, given document ids, of its own document.

    ids [b, S] (or None: causality alone) of the whole sequences; q_pos and k_pos the positions of the queries and
    keys, each rising. A query's keys are then one range [start, end), whose ends do not fall from one query to the
    next, and once a query sees none no later one does (what model/causal.py's chunks rely on). `dense`: make the
    whole mask now (where attention would make it inside a compiled block)."""

    def __init__(self, ids: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype,
                 dense: bool = False):
        self.q_pos, self.k_pos, self.dtype = q_pos, k_pos, dtype
        self.q_ids, self.k_ids = (None, None) if ids is None else (ids[:, q_pos], ids[:, k_pos])
        self._pattern = self._ranges = None
        self._dense = self._additive(self.seen(0, len(q_pos), 0, len(k_pos))) if dense else None

    def seen(self, a: int, e: int, lo: int, hi: int) -> torch.Tensor:
        """bool [b, 1, e - a, hi - lo]: queries a to e over keys lo to hi ([e - a, hi - lo] by causality alone: the
        same in every row, and the CPU kernel takes a mask of two dimensions faster than one broadcast over the
        batch)."""
        seen = self.k_pos[lo:hi] <= self.q_pos[a:e, None]
        if self.q_ids is None:
            return seen
        return (seen & (self.q_ids[:, a:e, None] == self.k_ids[:, None, lo:hi]))[:, None]

    def block(self, a: int, e: int, lo: int, hi: int) -> torch.Tensor:
        """The additive mask of queries a to e over keys lo to hi, shaped as `seen`. By causality alone, for a chunk
        of consecutive positions over consecutive keys, a view of one pattern made once."""
        m = len(self.k_pos)
        if self.q_ids is None and e - a <= PATTERN_ROWS and _consecutive(self.q_pos, a, e) and \
                _consecutive(self.k_pos, lo, hi):
            start = m + int(self.k_pos[lo] - self.q_pos[a])  # row i hides column c of the pattern where c - m > i
            if 0 <= start and start + hi - lo <= 2 * m:
                return self._causal_pattern()[:e - a, start:start + hi - lo]
        return self._additive(self.seen(a, e, lo, hi))

    def _additive(self, seen: torch.Tensor) -> torch.Tensor:
        return torch.where(seen, torch.zeros((), dtype=self.dtype, device=seen.device), -math.inf)

    def _causal_pattern(self) -> torch.Tensor:
        if self._pattern is None:
            m, device = len(self.k_pos), self.k_pos.device
            rows = torch.arange(PATTERN_ROWS, device=device)[:, None]
            hidden = torch.arange(2 * m, device=device)[None, :] > rows + m
            self._pattern = torch.zeros(hidden.shape, dtype=self.dtype, device=device).masked_fill_(hidden, -math.inf)
        return self._pattern

    def dense(self) -> torch.Tensor:
        """The additive mask of every query over every key, made once (a tensor of its own, not a view of the
        pattern: attention saves it)."""
        if self._dense is None:
            self._dense = self._additive(self.seen(0, len(self.q_pos), 0, len(self.k_pos)))
        return self._dense

    def ranges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's keys [start, end) in each row, [b, n] each (end <= start: it sees none), worked out once for
        every layer's forward and backward."""
        if self._ranges is None:
            end = torch.searchsorted(self.k_pos, self.q_pos, right=True)[None]
            if self.q_ids is None:
                self._ranges = torch.zeros_like(end), end
            else:
                start = torch.searchsorted(self.k_ids, self.q_ids)
                self._ranges = start, torch.minimum(torch.searchsorted(self.k_ids, self.q_ids, right=True), end)
        return self._ranges

    def blind(self) -> torch.Tensor:
        """bool [b, 1, 1, n]: the queries that see no key."""
        start, end = self.ranges()
        return (end <= start)[:, None, None]


def _consecutive(pos: torch.Tensor, a: int, e: int) -> bool:
    """Whether the rising positions a to e follow one another."""
    return int(pos[e - 1] - pos[a]) == e - a - 1
