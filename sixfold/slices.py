"""Slices of tensors by global name: where a rank's part lies in the full tensor, and any part read back from
the slices a checkpoint holds, whatever layout wrote them.

A slice is the range [start, stop) of one flattened piece of a full tensor: the piece `index` of `parts`
cut along `dim` (a tensor- or expert-parallel piece; the last one padded with zeros up to `padded` rows), or
the whole tensor (parts 1). That is what one rank's flat shard holds of one parameter. A slice asked for in
the cut that wrote it is copied from the saved ranges; in any other cut, positions in the full tensor are
matched, and only the saved slices that hold some of them are read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .checkpoint import CheckpointError, Checkpoint
from .parallel.tensor import Split


@dataclass(frozen=True)
class Cut:
    dim: int = 0
    parts: int = 1
    index: int = 0
    padded: int = 0  # rows along dim after padding; 0: not padded

    @classmethod
    def of(cls, split: Split) -> "Cut":
        if split.parts == 1:
            return cls()
        return cls(split.dim, split.parts, split.index, split.padded if split.padded > split.full else 0)

    def _sizes(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """Rows along dim in the full tensor, in a piece, and elements per row (the dims after dim)."""
        rows = shape[self.dim]
        return rows, (self.padded or rows) // self.parts, math.prod(shape[self.dim + 1:])

    def positions(self, shape: tuple[int, ...], start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The flat index in the full tensor of elements [start, stop) of the flattened piece (-1 for padding),
        increasing apart from the padding."""
        if self.parts == 1:
            return torch.arange(start, math.prod(shape) if stop is None else stop)
        rows, size, inner = self._sizes(shape)
        i = torch.arange(start, math.prod(shape[:self.dim]) * size * inner if stop is None else stop)
        outer, rest = i // (size * inner), i % (size * inner)
        row = self.index * size + rest // inner
        return ((outer * rows + row) * inner + rest % inner).masked_fill_(row >= rows, -1)

    def locate(self, shape: tuple[int, ...], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For flat indices in the full tensor: the piece of this cut's parts that holds each, and the element's
        place in that piece's flattening (the inverse of positions)."""
        if self.parts == 1:
            return torch.zeros_like(positions), positions
        rows, size, inner = self._sizes(shape)
        outer, row, col = positions // (rows * inner), positions // inner % rows, positions % inner
        piece = row // size
        return piece, (outer * size + row - piece * size) * inner + col

    def as_list(self) -> list[int]:
        return [self.dim, self.parts, self.index, self.padded]


class Reader:
    """A checkpoint's tensors of one kind ("model" or "optim") by global name, read slice by slice."""

    def __init__(self, checkpoint: Checkpoint, kind: str):
        self.ckpt, self.kind = checkpoint, kind
        self.entries = checkpoint.index(kind)

    def shapes(self) -> dict[str, torch.Size]:
        return {n: torch.Size(e["shape"]) for n, e in self.entries.items()}

    def _slice(self, name: str, s: dict) -> torch.Tensor:
        t = self.ckpt.tensor(s["file"], s["key"])
        if t.dtype != torch.float32 or t.numel() != s["stop"] - s["start"]:
            raise CheckpointError(f"{self.ckpt.path / s['file']}: {s['key']} is {t.dtype} with {t.numel()} elements; "
                                  f"the index of {name} expects float32 with {s['stop'] - s['start']}")
        return t.reshape(-1)

    def read(self, name: str, cut: Cut, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the flattened piece `cut` of tensor `name` (fp32; zeros in padding)."""
        entry = self.entries[name]
        out = torch.zeros(stop - start)
        done = torch.zeros(stop - start, dtype=torch.bool)
        for s in entry["slices"]:
            if Cut(*s["cut"]) == cut and s["start"] < stop and s["stop"] > start:
                a, b = max(start, s["start"]), min(stop, s["stop"])
                out[a - start:b - start] = self._slice(name, s)[a - s["start"]:b - s["start"]]
                done[a - start:b - start] = True
        if done.all():
            return out
        return self._matched(name, entry, cut, start, stop)

    def _matched(self, name: str, entry: dict, cut: Cut, start: int, stop: int) -> torch.Tensor:
        """The general path: each wanted element's place in the full tensor, then its place in each saved cut;
        memory and work grow with what is wanted, not with the full tensor."""
        shape = tuple(entry["shape"])
        want = cut.positions(shape, start, stop)
        real = (want >= 0).nonzero().squeeze(1)
        found = torch.zeros(len(real), dtype=torch.bool)
        out = torch.zeros(stop - start)
        located = {}
        for s in entry["slices"]:
            saved = Cut(*s["cut"])
            if saved not in located:
                located[saved] = saved.locate(shape, want[real])
            piece, at = located[saved]
            hit = ((piece == saved.index) & (at >= s["start"]) & (at < s["stop"])).nonzero().squeeze(1)
            if len(hit):
                out[real[hit]] = self._slice(name, s)[at[hit] - s["start"]]
                found[hit] = True
        if not found.all():
            raise CheckpointError(f"{self.ckpt.path}: no saved slice holds {int((~found).sum())} element(s) "
                                  f"of {name}; a shard of the checkpoint is missing from its index")
        return out

    def full(self, name: str) -> torch.Tensor:
        shape = self.shapes()[name]
        return self.read(name, Cut(), 0, math.prod(shape)).view(shape)

    def all(self) -> dict[str, torch.Tensor]:
        return {n: self.full(n) for n in self.entries}
