"""Flat buffers and data-parallel gradient reduction.

Parameters and their gradients are views into flat per-bucket buffers, so forward and backward make
no copies and the optimizer runs over a few large tensors. Buckets follow the reverse order of
registration (about the order backward finishes them). On the last micro-batch each bucket's
asynchronous all-reduce starts as soon as its last gradient is accumulated, in bucket order on every
rank, so communication overlaps the rest of backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import Comm, Pending


@dataclass
class Bucket:
    index: int
    names: list[str]
    params: list[nn.Parameter]
    data: torch.Tensor
    grad: torch.Tensor
    offsets: list[int] = field(default_factory=list)
    ready: int = 0
    pending: Pending | None = None

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-parameter views of a flat tensor laid out like this bucket."""
        return {n: flat[o:o + p.numel()].view_as(p) for n, p, o in zip(self.names, self.params, self.offsets)}


def _assign(params: list[tuple[str, nn.Parameter]], bucket_bytes: int) -> list[list[tuple[str, nn.Parameter]]]:
    groups, current, size = [], [], 0
    for name, p in params:
        current.append((name, p))
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


class FlatParameters:
    """The model's parameters moved into flat buckets (parameter data and gradients are views)."""

    def __init__(self, model: nn.Module, bucket_bytes: int):
        named = list(model.named_parameters())[::-1]
        self.buckets: list[Bucket] = []
        for i, members in enumerate(_assign(named, bucket_bytes)):
            total = sum(p.numel() for _, p in members)
            ref = members[0][1]
            data = torch.empty(total, dtype=ref.dtype, device=ref.device)
            grad = torch.zeros(total, dtype=ref.dtype, device=ref.device)
            bucket = Bucket(i, [n for n, _ in members], [p for _, p in members], data, grad)
            offset = 0
            for _, p in members:
                bucket.offsets.append(offset)
                n = p.numel()
                data[offset:offset + n].copy_(p.data.flatten())
                p.data = data[offset:offset + n].view_as(p)
                p.grad = grad[offset:offset + n].view_as(p)
                offset += n
            self.buckets.append(bucket)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad.zero_()

    def grad_norm_sq(self) -> float:
        """Squared L2 norm of all gradients: fp32 per bucket, summed in fp64."""
        return sum(float(b.grad.norm()) ** 2 for b in self.buckets)


class DataParallel:
    """Sums gradients over the ranks that hold the same parameters and read different data."""

    def __init__(self, flat: FlatParameters, comm: Comm, group: str = "loss"):
        self.flat, self.comm, self.group = flat, comm, group
        self.sync = False
        self._next = 0
        self._owner = {}
        if comm.ctx.size(group) > 1:
            for b in flat.buckets:
                for p in b.params:
                    self._owner[p] = b
                    p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.sync:
            return
        b = self._owner[p]
        b.ready += 1
        if b.ready == len(b.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start all-reduces in bucket order, never out of it (every rank must issue the same sequence)."""
        buckets = self.flat.buckets
        while self._next < len(buckets) and buckets[self._next].ready == len(buckets[self._next].params):
            self._launch(buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        b.pending = self.comm.all_reduce(b.grad, self.group, async_op=True, label=f"bucket {b.index}")

    def finish(self) -> None:
        """After the last micro-batch's backward: start what has not started, then wait for all."""
        if self.comm.ctx.size(self.group) == 1:
            return
        for b in self.flat.buckets[self._next:]:
            self._launch(b)
        for b in self.flat.buckets:
            b.pending.wait()
            b.pending, b.ready = None, 0
        self._next = 0
        self.sync = False
