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
import torch.nn.functional as F

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

    def positions(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The flat index in the full tensor of each element of the flattened piece (-1 for padding)."""
        idx = torch.arange(math.prod(shape)).view(shape)
        if self.parts == 1:
            return idx.reshape(-1)
        if self.padded:
            pad = [0, 0] * (len(shape) - 1 - self.dim) + [0, self.padded - shape[self.dim]]
            idx = F.pad(idx, pad, value=-1)
        size = (self.padded or shape[self.dim]) // self.parts
        return idx.narrow(self.dim, self.index * size, size).reshape(-1)

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
        """The general path: positions in the full tensor of what is wanted and of each saved slice."""
        shape = tuple(entry["shape"])
        want = cut.positions(shape)[start:stop]
        real = want >= 0
        wanted = torch.zeros(math.prod(shape), dtype=torch.bool)
        wanted[want[real]] = True
        full = torch.zeros(math.prod(shape))
        have = torch.zeros_like(wanted)
        for s in entry["slices"]:
            pos = Cut(*s["cut"]).positions(shape)[s["start"]:s["stop"]]
            keep = pos >= 0
            if wanted[pos[keep]].any():
                full[pos[keep]] = self._slice(name, s)[keep]
                have[pos[keep]] = True
        if not have[wanted].all():
            raise CheckpointError(f"{self.ckpt.path}: no saved slice holds {int((wanted & ~have).sum())} element(s) "
                                  f"of {name}; a shard of the checkpoint is missing from its index")
        out = torch.zeros(stop - start)
        out[real] = full[want[real]]
        return out

    def full(self, name: str) -> torch.Tensor:
        shape = self.shapes()[name]
        return self.read(name, Cut(), 0, math.prod(shape)).view(shape)

    def all(self) -> dict[str, torch.Tensor]:
        return {n: self.full(n) for n in self.entries}
