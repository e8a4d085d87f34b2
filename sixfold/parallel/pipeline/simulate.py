"""Run a schedule's action lists on every rank at once, with given costs: prove it sound and time it.

Each rank runs its list in order. Compute actions take their cost. Sends and receives between two ranks
are matched in posting order, as NCCL matches them (it has no tags), and a mismatch is an error.
Two ways to run the communication:
  buffered (default)  a SEND completes at once; a RECV waits for its SEND's posting plus the latency
  batched             each run of consecutive SENDs and RECVs is posted as one batch (batch_isend_irecv)
                      and completes when every one of its messages has been posted at both ends;
                      this proves that batching adjacent communication cannot deadlock
Checked: the right stage on the right rank, one F and one B per (stage, micro) and at most one W (after
its B), F of stage s after F of s - 1, B of stage s after F of s and after B of s + 1, every SEND
received exactly once, and no deadlock (the error shows what each stuck rank waits for).
"""
from __future__ import annotations

from dataclasses import dataclass

from .schedules import B, COMPUTE, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule


class ScheduleError(ValueError):
    """A schedule that cannot run as written."""


@dataclass(frozen=True)
class Costs:
    f: float = 1.0  # forward of one stage for one micro-batch
    b: float = 1.0  # input gradient
    w: float = 1.0  # weight gradient: a B with no W of its own does both and costs b + w
    comm: float = 0.0  # latency from a message's posting to its data being usable


@dataclass(frozen=True)
class RankStats:
    finish: float
    busy: float
    bubble: float  # idle fraction of the makespan: 1 - busy / makespan
    peak_in_flight: int  # most (stage, micro) pairs whose saved activations are alive at once
    events: tuple[tuple[float, float, Action], ...]  # (start, end, action) in list order


@dataclass(frozen=True)
class Simulation:
    makespan: float
    ranks: tuple[RankStats, ...]

    @property
    def bubble(self) -> float:
        """Idle fraction over all ranks."""
        return sum(r.bubble for r in self.ranks) / len(self.ranks)


def _source(a: Action) -> Action:
    """The SEND that a RECV receives."""
    if a.kind == RECV_F:
        return Action(SEND_F, a.stage - 1, a.micro)
    return Action(SEND_B, a.stage + 1, a.micro)


class _Run:
    def __init__(self, schedule: Schedule, costs: Costs, batched: bool, release: str):
        self.s, self.costs, self.batched, self.release = schedule, costs, batched, release
        self.split = {(a.stage, a.micro) for acts in schedule.ranks for a in acts if a.kind == W}
        n = schedule.pp
        self.pos, self.clock, self.busy = [0] * n, [0.0] * n, [0.0] * n
        self.events: list[list[tuple[float, float, Action]]] = [[] for _ in range(n)]
        self.alive: list[set[tuple[int, int]]] = [set() for _ in range(n)]
        self.peak = [0] * n
        self.done: dict[Action, float] = {}  # every finished action, with its end time
        self.sends: dict[tuple[int, int], list[tuple[Action, float]]] = {}  # (src, dst) -> posted, in order
        self.recvs: dict[tuple[int, int], list[tuple[Action, float]]] = {}
        self.pending: list[list[tuple[Action, tuple[int, int], int, float]] | None] = [None] * n

    def fail(self, r: int, a: Action, why: str) -> ScheduleError:
        return ScheduleError(f"{self.s.name} pp={self.s.pp} v={self.s.v} m={self.s.m}: rank {r}, "
                             f"action {self.pos[r]} {a!r}: {why}")

    def need(self, r: int, a: Action, dep: Action) -> None:
        if dep not in self.done:
            raise self.fail(r, a, f"runs before {dep!r}")

    def where(self, r: int, a: Action) -> None:
        if not (0 <= a.stage < self.s.stages and 0 <= a.micro < self.s.m):
            raise self.fail(r, a, "no such stage or micro-batch")
        if self.s.placement[a.stage] != r:
            raise self.fail(r, a, f"stage {a.stage} is on rank {self.s.placement[a.stage]}")
        if a in self.done:
            raise self.fail(r, a, "runs twice")

    def compute(self, r: int, a: Action) -> None:
        self.where(r, a)
        s, m, last, place = a.stage, a.micro, self.s.stages - 1, self.s.placement
        if a.kind == F and s > 0:
            self.need(r, a, Action(F, s - 1, m) if place[s - 1] == r else Action(RECV_F, s, m))
        if a.kind == B:
            self.need(r, a, Action(F, s, m))
            if s < last:
                self.need(r, a, Action(B, s + 1, m) if place[s + 1] == r else Action(RECV_B, s, m))
        if a.kind == W:
            self.need(r, a, Action(B, s, m))
        split = (s, m) in self.split
        cost = {F: self.costs.f, W: self.costs.w}.get(a.kind, self.costs.b + (0 if split else self.costs.w))
        start = self.clock[r]
        self.clock[r] += cost
        self.busy[r] += cost
        self.done[a] = self.clock[r]
        self.events[r].append((start, self.clock[r], a))
        if a.kind == F:
            self.alive[r].add((s, m))
            self.peak[r] = max(self.peak[r], len(self.alive[r]))
        elif a.kind == W or not split or self.release == "B":
            self.alive[r].discard((s, m))

    def post(self, r: int, a: Action) -> tuple[Action, tuple[int, int], int, float]:
        self.where(r, a)
        if a.kind in (SEND_F, RECV_B) and a.stage == self.s.stages - 1 or a.kind in (RECV_F, SEND_B) and a.stage == 0:
            raise self.fail(r, a, "no stage on the other side")
        peer = self.s.peer(a)
        if peer == r:
            raise self.fail(r, a, "both stages are on this rank; they pass data locally")
        if a.kind in (SEND_F, SEND_B):
            self.need(r, a, Action(F if a.kind == SEND_F else B, a.stage, a.micro))
            channel, posted = (r, peer), self.sends
        else:
            channel, posted = (peer, r), self.recvs
        queue = posted.setdefault(channel, [])
        queue.append((a, self.clock[r]))
        return a, channel, len(queue) - 1, self.clock[r]

    def finish(self, r: int) -> float | list[str]:
        """When the posted batch of rank r completes, or what it still waits for."""
        end, waits = self.clock[r], []
        for a, channel, k, t in self.pending[r]:
            if a.kind in (RECV_F, RECV_B):
                queue = self.sends.get(channel, [])
                if len(queue) <= k:
                    waits.append(f"{a!r} waits for {_source(a)!r} from rank {channel[0]}")
                    continue
                sent, t_sent = queue[k]
                if sent != _source(a):
                    raise self.fail(r, a, f"message {k} from rank {channel[0]} is {sent!r}: sends and receives "
                                          "between two ranks must be posted in the same order")
                end = max(end, max(t, t_sent) + self.costs.comm if self.batched else max(t, t_sent + self.costs.comm))
            elif self.batched:
                queue = self.recvs.get(channel, [])
                if len(queue) <= k:
                    waits.append(f"{a!r} waits for rank {channel[1]} to post its receive")
                    continue
                end = max(end, max(t, queue[k][1]) + self.costs.comm)
        return waits or end

    def advance(self, r: int) -> bool:
        """Run rank r as far as it can go; True if it moved."""
        acts, moved = self.s.ranks[r], False
        while self.pos[r] < len(acts):
            a = acts[self.pos[r]]
            if a.kind in COMPUTE:
                self.compute(r, a)
                self.pos[r] += 1
                moved = True
                continue
            if self.pending[r] is None:
                stop = self.pos[r] + 1
                while self.batched and stop < len(acts) and acts[stop].kind not in COMPUTE:
                    stop += 1
                self.pending[r] = [self.post(r, c) for c in acts[self.pos[r]:stop]]
                moved = True
            end = self.finish(r)
            if isinstance(end, list):
                return moved
            for c, *_ in self.pending[r]:
                self.done[c] = end
            self.pos[r] += len(self.pending[r])
            self.clock[r], self.pending[r] = end, None
        return moved

    def run(self) -> Simulation:
        ranks = range(self.s.pp)
        while any(self.pos[r] < len(self.s.ranks[r]) for r in ranks):
            if not any([self.advance(r) for r in ranks]):
                stuck = [f"rank {r} at action {self.pos[r]}: " + "; ".join(self.finish(r))
                         for r in ranks if self.pos[r] < len(self.s.ranks[r])]
                raise ScheduleError(f"{self.s.name} pp={self.s.pp} v={self.s.v} m={self.s.m} deadlocks:\n  "
                                    + "\n  ".join(stuck))
        self.check_complete()
        makespan = max(self.clock, default=0.0)
        return Simulation(makespan, tuple(
            RankStats(self.clock[r], self.busy[r], 1 - self.busy[r] / makespan if makespan else 0.0,
                      self.peak[r], tuple(self.events[r])) for r in ranks))

    def check_complete(self) -> None:
        head = f"{self.s.name} pp={self.s.pp} v={self.s.v} m={self.s.m}: "
        for s in range(self.s.stages):
            for m in range(self.s.m):
                for kind in (F, B):
                    if Action(kind, s, m) not in self.done:
                        raise ScheduleError(head + f"{Action(kind, s, m)!r} never runs")
        for channel, queue in self.sends.items():
            received = len(self.recvs.get(channel, []))
            if received < len(queue):
                raise ScheduleError(head + f"{queue[received][0]!r} from rank {channel[0]} is never received")


def simulate(schedule: Schedule, costs: Costs = Costs(), batched: bool = False, release: str = "W") -> Simulation:
    """Check and time a schedule. release: when a (stage, micro) stops counting as in flight, at its B
    or at its W ("W", the default: W still needs the saved input; a B with no W of its own releases)."""
    if release not in ("B", "W"):
        raise ValueError(f"release={release!r} must be 'B' or 'W'")
    return _Run(schedule, costs, batched, release).run()
