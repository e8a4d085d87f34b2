"""Expert parallelism: token rows go to the ep rank holding their expert and come back, by all_to_all with
variable splits whose sizes are exchanged first.

The ep group is `ep` consecutive ranks of the flattened (dp_shard, cp) index (docs/guide/README.md); rank j
holds experts j*L .. (j+1)*L - 1 of the E experts (L = E / ep).
"""
from __future__ import annotations

import torch

from ..comm import Comm


class _AllToAll(torch.autograd.Function):
    """Rows to every ep rank (`send[j]` of them to rank j, `recv[j]` from it); backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, comm: Comm, send: list[int], recv: list[int], label: str):
        ctx.comm, ctx.send, ctx.recv, ctx.label = comm, send, recv, label
        return comm.all_to_all_v(x, send, recv, "ep", label)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_to_all_v(grad.contiguous(), ctx.recv, ctx.send, "ep", ctx.label), None, None, None, None


class ExpertParallel:
    """This rank's place in the ep group and the dispatch of rows to experts."""

    def __init__(self, comm: Comm | None = None):
        self.comm = comm
        self.size = comm.ctx.size("ep") if comm is not None else 1
        self.rank = comm.ctx.rank_in("ep") if comm is not None else 0

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, list[int], tuple]:
        """rows [n, dim] sorted by expert, counts [E] rows per expert -> the rows for this rank's L experts,
        sorted by local expert, their counts (L numbers), and what combine() needs to send the results back.
        The one wait for the device: the counts, which size the all-to-all and the experts' products."""
        if self.size == 1:
            return rows, counts.tolist(), ()
        local = counts.numel() // self.size
        mine = torch.empty_like(counts)
        self.comm.all_to_all(mine, counts, "ep", label="expert counts")  # [src, local expert] row counts
        sent, by_source = torch.stack([counts, mine]).view(2, self.size, local).tolist()
        send, recv = [sum(c) for c in sent], [sum(c) for c in by_source]
        got = _AllToAll.apply(rows, self.comm, send, recv, "dispatch")
        # received rows are grouped by source, then expert: regroup by expert, then source
        order = torch.arange(got.shape[0], device=rows.device).split([n for c in by_source for n in c])
        order = torch.cat([order[s * local + e] for e in range(local) for s in range(self.size)])
        return got[order], [sum(c[e] for c in by_source) for e in range(local)], (order, send, recv)

    def combine(self, out: torch.Tensor, back: tuple) -> torch.Tensor:
        """The experts' output rows back to the ranks and order they came from."""
        if not back:
            return out
        order, send, recv = back
        restored = out[torch.argsort(order)]
        return _AllToAll.apply(restored, self.comm, recv, send, "combine")
