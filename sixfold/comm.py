"""Collectives over the named groups, each counted in the communication ledger and traced."""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from .ledger import Ledger
from .errors import collective
from .mesh import ParallelContext
from .rollcall import RollCall
from .trace import Tracer, now_us

# torch 2.13 renamed these; 2.11 and 2.12 have only the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Watcher:
    """While tracing: stamps the time each pending collective completes. On gloo a collective's future tells it (a
    point-to-point work has none and reports completion only once waited for, so it is not watched); on other
    backends, whose futures complete at launch, a thread polls every millisecond while any is pending and drops a
    collective once waited for."""

    def __init__(self, polls: bool):
        self.polls = polls
        self.pending: list["Pending"] = []
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def watch(self, p: "Pending") -> None:
        if not self.polls:
            if not isinstance(p.work, list):
                p.work.get_future().then(lambda _: setattr(p, "done_at", now_us()))
            return
        with self.lock:
            self.pending.append(p)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            with self.lock:
                for p in list(self.pending):
                    if p.work is None:
                        self.pending.remove(p)
                    elif all(w.is_completed() for w in p.works):
                        p.done_at = now_us()
                        self.pending.remove(p)
                if not self.pending:
                    self.thread = None
                    return
            time.sleep(0.001)


class Pending:
    """An asynchronous collective; wait() completes it and closes its trace span, which ends when the collective
    completed (while tracing, stamped by the watcher) or else when wait() returned (a message on gloo), and records
    how long wait() blocked."""

    def __init__(self, work, tracer: Tracer, name: str, start: float, args: dict, ranks: tuple[int, ...] = (),
                 watcher: _Watcher | None = None, roll_call: RollCall | None = None):
        self.work, self.tracer, self.name, self.start, self.args, self.ranks = work, tracer, name, start, args, ranks
        self.roll_call = roll_call
        self.works = work if isinstance(work, list) else [work]
        self.done_at: float | None = None
        self.step = tracer.step if tracer.enabled else None  # traced: a span of the step that issued it
        self.then = None  # local work that completes the collective, run by wait()
        if watcher is not None and tracer.enabled and work is not None:
            watcher.watch(self)

    def wait(self) -> None:
        if self.work is not None:
            began = now_us()
            with collective(self.name, self.ranks, roll_call=self.roll_call):
                for work in self.works:
                    work.wait()
            self.work, self.works = None, []
            if self.then is not None:
                self.then()
                self.then = None
            end = now_us()
            if self.step is not None:
                self.tracer.add(self.name, "comm", self.start, min(end, self.done_at or end), step=self.step,
                                waited_us=end - began, wait_after_us=began - self.start, ranks=list(self.ranks),
                                **self.args)


class Comm:
    def __init__(self, ctx: ParallelContext, tracer: Tracer, ledger: Ledger | None = None):
        self.ctx, self.tracer = ctx, tracer
        self.ledger = ledger or Ledger()
        self.watcher = _Watcher(polls=ctx.backend != "gloo")

    def _run(self, op: str, group: str, nbytes: int, label: str, async_op: bool, call,
             ranks: list[int] | None = None, pg: dist.ProcessGroup | None = None) -> Pending:
        """`ranks`: those taking part (the group's members unless given: a point-to-point batch's peers); `pg`: the
        process group it runs on, if not the group's own (its host twin)."""
        self.ledger.record(group, op, nbytes)
        name = f"{op} {group}{' ' + label if label else ''}"
        ranks = ranks or self.ctx.members(group)
        start = now_us()
        with collective(name, ranks, roll_call=self.ctx.roll_call):
            work = call(pg or self.ctx.groups[group], async_op)
        args = {"group": group, "op": op, "bytes": nbytes, **({"async": True} if async_op else {})}
        if not async_op:  # (ranks: when the last one had posted it, overlap() counts it as communication)
            self.tracer.add(name, "comm", start, now_us(), ranks=list(ranks), **args)
        return Pending(work if async_op else None, self.tracer, name, start, args, ranks, self.watcher,
                       self.ctx.roll_call)

    def all_reduce(self, t: torch.Tensor, group: str, async_op: bool = False, label: str = "",
                   op=dist.ReduceOp.SUM, pg: dist.ProcessGroup | None = None) -> Pending | None:
        """Sum (or `op`) `t` in place over `group` (on `pg`, its host twin, if given); a no-op on a group of one."""
        if self.ctx.size(group) == 1:
            return None
        return self._run("all_reduce", group, t.numel() * t.element_size(), label, async_op,
                         lambda g, a: dist.all_reduce(t, op=op, group=g, async_op=a), pg=pg)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, group: str, async_op: bool = False,
                       label: str = "") -> Pending | None:
        """`out` = this rank's slice of the sum of `full` over `group` (bytes counted: the full input)."""
        n = self.ctx.size(group)
        if n == 1:
            out.copy_(full)
            return None
        nbytes = full.numel() * full.element_size()
        if full.device.type != "cpu":
            return self._run("reduce_scatter", group, nbytes, label, async_op,
                             lambda g, a: _reduce_scatter(out, full, group=g, async_op=a))
        # gloo's reduce-scatter takes longer than its all-reduce; an all-to-all of the slices, then their sum here,
        # takes a third to a half of its time (bench/collectives.py)
        rows = torch.empty_like(full)
        pending = self._run("reduce_scatter", group, nbytes, label, async_op,
                            lambda g, a: dist.all_to_all_single(rows, full, group=g, async_op=a))

        def finish() -> None:
            torch.sum(rows.view(n, -1), 0, out=out.view(-1))
            rows.untyped_storage().resize_(0)  # freed now, not whenever gloo's thread lets go of the collective
        pending.then = finish
        if not async_op:
            pending.then()
        return pending

    def stages_reduce_scatter(self, full: torch.Tensor, group: str) -> bool:
        """Whether reduce_scatter of `full` over `group` holds a buffer of its size until it completes (on CPU)."""
        return self.ctx.size(group) > 1 and full.device.type == "cpu"

    def all_gather(self, full: torch.Tensor, part: torch.Tensor, group: str, async_op: bool = False,
                   label: str = "") -> Pending | None:
        """`full` = the concatenation of every rank's `part` (bytes counted: the full output)."""
        if self.ctx.size(group) == 1:
            full.copy_(part)
            return None
        return self._run("all_gather", group, full.numel() * full.element_size(), label, async_op,
                         lambda g, a: _all_gather(full, part, group=g, async_op=a))

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, group: str, label: str = "") -> None:
        """Equal slices along dim 0: slice j of `x` goes to the group's rank j; `out` gets every rank's slice."""
        self._run("all_to_all", group, x.numel() * x.element_size(), label, False,
                  lambda g, a: dist.all_to_all_single(out, x, group=g, async_op=a))

    def all_to_all_v(self, x: torch.Tensor, send: list[int], recv: list[int], group: str,
                     label: str = "") -> torch.Tensor:
        """Rows of `x` to the group's ranks, `send[j]` to rank j; returns the `recv[j]` rows from each rank j."""
        out = x.new_empty((sum(recv), *x.shape[1:]))
        self._run("all_to_all", group, x.numel() * x.element_size(), label, False,
                  lambda g, a: dist.all_to_all_single(out, x, recv, send, group=g, async_op=a))
        return out

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: str,
                 label: str = "") -> Pending:
        """Start point-to-point sends and receives (tensor, rank within `group`) as one batch."""
        ranks = self.ctx.members(group)
        ops = [dist.P2POp(dist.isend, t, ranks[r], self.ctx.groups[group]) for t, r in sends] + \
              [dist.P2POp(dist.irecv, t, ranks[r], self.ctx.groups[group]) for t, r in recvs]
        nbytes = sum(t.numel() * t.element_size() for t, _ in sends)
        peers = sorted({ranks[r] for _, r in sends + recvs} | {self.ctx.rank})
        return self._run("send_recv", group, nbytes, label, True, lambda g, a: dist.batch_isend_irecv(ops), peers)

    def gather_objects(self, obj, group: str) -> list:
        """Every member's `obj` (pickled in transit), on the group's first rank; elsewhere [obj]."""
        ranks = self.ctx.members(group)
        if len(ranks) == 1:
            return [obj]
        out = [None] * len(ranks) if self.ctx.rank == ranks[0] else None
        with collective(f"gather_object {group}", ranks, roll_call=self.ctx.roll_call):
            dist.gather_object(obj, out, dst=ranks[0], group=self.ctx.groups[group])
        return out if out is not None else [obj]

    def broadcast(self, t: torch.Tensor, group: str, src: int) -> None:
        """`t` from the group's rank `src` to every member, in place."""
        if self.ctx.size(group) > 1:
            self._run("broadcast", group, t.numel() * t.element_size(), "", False,
                      lambda g, a: dist.broadcast(t, self.ctx.members(group)[src], group=g, async_op=a))

    def sum_scalars(self, values: list[float], group: str) -> list[float]:
        """Sum a few fp64 scalars over `group` in one collective; on a group of one, as they are (a round trip
        through the device would wait for its queued work). Over the world or the loss group, on its host twin
        (mesh.HOST_GROUPS), behind no other work."""
        if self.ctx.size(group) == 1:
            return [float(v) for v in values]
        host = self.ctx.host.get(group)
        t = torch.tensor(values, dtype=torch.float64, device="cpu" if host else self.ctx.device)
        self.all_reduce(t, group, label="scalars", pg=host)
        return t.tolist()
