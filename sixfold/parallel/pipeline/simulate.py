"""Run a schedule's action lists on every rank at once, with given costs: prove it sound and time it.

Each rank runs its list in order; compute actions take their cost. Messages between two ranks are matched
in posting order, as NCCL matches them (it has no tags); a message out of order is an error. Two models:
  buffered (default)  as the runtime runs: a SEND completes at once; a RECV is posted where it stands and the
                      compute that uses its data waits for it, until its SEND is posted plus the latency;
                      with early (default), a B that computes its weight gradient too sends its input gradient
                      before it (Schedule.sends_early), after b of its b + w
  batched             each run of adjacent SENDs and RECVs is posted as one batch (batch_isend_irecv) that
                      completes once each of its messages is posted at both ends; passing proves that
                      batching adjacent communication cannot deadlock, even where a send waits for its receive
Checked: each action on the rank of its stage; one F and one B per (stage, micro), at most one W and after
its B; F of stage s after F of s - 1; B of stage s after F of s and after B of s + 1; every SEND received
once; no deadlock (the error shows what each stuck rank waits for).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .schedules import B, COMPUTE, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule

Posted = tuple[Action, tuple[int, int], int, float]  # message, (src, dst), index on that channel, post time


class ScheduleError(ValueError):
    """A schedule that cannot run as written."""


Cost = float | tuple[float, ...]  # one value for every stage, or one per stage


@dataclass(frozen=True)
class Costs:
    f: Cost = 1.0  # forward of one stage for one micro-batch
    b: Cost = 1.0  # input gradient
    w: Cost = 1.0  # weight gradient; a B with no W of its own computes both and costs b + w
    comm: float = 0.0  # latency from a message's posting to its data being usable

    def of(self, kind: str, stage: int) -> float:
        """The cost of a compute action of `kind` (F, B or W) on `stage`."""
        cost = self.f if kind == F else self.w if kind == W else self.b
        return cost[stage] if isinstance(cost, tuple) else cost


@dataclass(frozen=True)
class RankStats:
    finish: float
    busy: float
    bubble: float  # idle fraction of the makespan: 1 - busy / makespan
    peak_in_flight: int  # most (stage, micro) pairs with saved activations alive at once
    events: tuple[tuple[float, float, Action], ...]  # (start, end, action) for each action, in list order
    # each distinct crowd of pairs alive after a forward or a B that leaves its weight gradient to a W, as (stage,
    # pairs of that stage, those of them past their B and waiting for their W) for the rank's stages
    crowds: frozenset[tuple[tuple[int, int, int], ...]] = frozenset()
    backward_crowds: frozenset[tuple[tuple[int, int, int], ...]] = frozenset()  # those alive as a B begins


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
    def __init__(self, schedule: Schedule, costs: Costs, batched: bool, release: str,
                 durations: dict[Action, float] | None, early: bool):
        self.s, self.costs, self.batched, self.release = schedule, costs, batched, release
        self.durations = durations or {}
        self.head = f"{schedule.name} pp={schedule.pp} v={schedule.v} m={schedule.m}"
        for name in ("f", "b", "w"):
            cost = getattr(costs, name)
            if isinstance(cost, tuple) and len(cost) != schedule.stages:
                raise ValueError(f"{self.head}: costs.{name} has {len(cost)} values, one per stage needs "
                                 f"{schedule.stages}")
        self.split = {(a.stage, a.micro) for acts in schedule.ranks for a in acts if a.kind == W}
        self.early = set().union(*(schedule.sends_early(r) for r in range(schedule.pp))) if early else set()
        n = schedule.pp
        self.pos, self.clock, self.busy, self.peak = [0] * n, [0.0] * n, [0.0] * n, [0] * n
        self.crowds: list[set[tuple[tuple[int, int, int], ...]]] = [set() for _ in range(n)]
        self.backward_crowds: list[set[tuple[tuple[int, int, int], ...]]] = [set() for _ in range(n)]
        self.ready = [0.0] * n  # when the data of each rank's last compute could be sent
        self.events: list[list[tuple[float, float, Action]]] = [[] for _ in range(n)]
        self.alive: list[set[tuple[int, int]]] = [set() for _ in range(n)]
        self.waiting: list[set[tuple[int, int]]] = [set() for _ in range(n)]  # of those, past B, before W
        self.done: dict[Action, float] = {}  # every finished action, with its end time
        # (src, dst) -> the messages sent and the receives posted on that channel, with their post times and
        # their index in the posting rank's list
        self.sends: dict[tuple[int, int], list[tuple[Action, float, int]]] = {}
        self.recvs: dict[tuple[int, int], list[tuple[Action, float, int]]] = {}
        self.pending: list[list[Posted] | None] = [None] * n  # batched: each rank's posted, unfinished batch
        # buffered: each rank's posted receives whose data no compute has used yet, with their index in its events
        self.posted: list[dict[Action, tuple[Posted, int]]] = [{} for _ in range(n)]

    def fail(self, r: int, a: Action, why: str, at: int | None = None) -> ScheduleError:
        at = self.s.ranks[r].index(a, self.pos[r]) if at is None else at
        return ScheduleError(f"{self.head}: rank {r}, action {at} {a!r}: {why}")

    def need(self, r: int, a: Action, dep: Action) -> None:
        if dep not in self.done:
            raise self.fail(r, a, f"runs before {dep!r}")

    def check_place(self, r: int, a: Action, at: int | None = None) -> None:
        if not (0 <= a.stage < self.s.stages and 0 <= a.micro < self.s.m):
            raise self.fail(r, a, "no such stage or micro-batch", at)
        if self.s.placement[a.stage] != r:
            raise self.fail(r, a, f"stage {a.stage} is on rank {self.s.placement[a.stage]}", at)
        if a in self.done or a in self.posted[r]:
            raise self.fail(r, a, "runs twice", at)

    def inputs(self, r: int, a: Action) -> list[Action]:
        """The actions whose results compute action a uses: a compute on this rank or a RECV."""
        s, m, last, place = a.stage, a.micro, self.s.stages - 1, self.s.placement
        if a.kind == F:
            return [] if s == 0 else [Action(F, s - 1, m) if place[s - 1] == r else Action(RECV_F, s, m)]
        if a.kind == B:
            return [Action(F, s, m)] + ([] if s == last else
                                        [Action(B, s + 1, m) if place[s + 1] == r else Action(RECV_B, s, m)])
        return [Action(B, s, m)]

    def received(self, r: int, recv: Action) -> float | None:
        """Buffered: when a posted receive's data is usable, marking it done; None while its SEND is not posted."""
        (_, channel, k, t), event = self.posted[r][recv]
        queue = self.sends.get(channel, [])
        if len(queue) <= k:
            return None
        end = max(t, queue[k][1] + self.costs.comm)
        del self.posted[r][recv]
        self.done[recv] = end
        self.events[r][event] = (t, end, recv)
        return end

    def compute(self, r: int, a: Action) -> bool:
        """Run compute action a on rank r; False while it waits for a message."""
        self.check_place(r, a)
        start = self.clock[r]
        for dep in self.inputs(r, a):
            if dep in self.posted[r]:
                ready = self.received(r, dep)
                if ready is None:
                    return False
                start = max(start, ready)
            self.need(r, a, dep)
        s, m = a.stage, a.micro
        split = (s, m) in self.split
        own = self.durations.get(a)
        cost = self.costs.of(a.kind, s) if own is None else own
        weights = 0.0  # a B's weight gradient where no W computes it (replayed: its own span, if traced apart)
        if a.kind == B and not split:
            weights = self.durations.get(Action(W, s, m), self.costs.of(W, s) if own is None else 0.0)
        self.clock[r] = start + cost + weights
        self.ready[r] = start + cost if (s, m) in self.early else self.clock[r]
        self.busy[r] += cost + weights
        self.done[a] = self.clock[r]
        self.events[r].append((start, self.clock[r], a))
        if a.kind == B:
            self.backward_crowds[r].add(self.crowd(r))
        if a.kind == F:
            self.alive[r].add((s, m))
            self.peak[r] = max(self.peak[r], len(self.alive[r]))
            self.crowds[r].add(self.crowd(r))
        elif a.kind == W or not split or self.release == "B":
            self.alive[r].discard((s, m))
            self.waiting[r].discard((s, m))
        else:  # a B whose W is to come: its pair holds what the W needs
            self.waiting[r].add((s, m))
            self.crowds[r].add(self.crowd(r))
        return True

    def crowd(self, r: int) -> tuple[tuple[int, int, int], ...]:
        """Rank r's pairs alive now, as (stage, pairs, those past their B) for each of its stages with any."""
        alive, waiting = (Counter(st for st, _ in pairs) for pairs in (self.alive[r], self.waiting[r]))
        return tuple((st, n, waiting[st]) for st, n in sorted(alive.items()))

    def post(self, r: int, a: Action, at: int) -> Posted:
        """Post the SEND or RECV at index `at` of rank r's list."""
        self.check_place(r, a, at)
        to_next = a.kind in (SEND_F, RECV_B)
        if a.stage == (self.s.stages - 1 if to_next else 0):
            raise self.fail(r, a, "no stage on the other side", at)
        peer = self.s.peer(a)
        if peer == r:
            raise self.fail(r, a, "both stages are on this rank, which passes the data locally", at)
        when = self.clock[r]
        if a.kind in (SEND_F, SEND_B):
            self.need(r, a, Action(F if a.kind == SEND_F else B, a.stage, a.micro))
            channel, posted, when = (r, peer), self.sends, self.ready[r]
        else:
            channel, posted = (peer, r), self.recvs
        queue = posted.setdefault(channel, [])
        queue.append((a, when, at))
        k = len(queue) - 1
        sends, recvs = self.sends.get(channel, []), self.recvs.get(channel, [])
        if k < len(sends) and k < len(recvs) and sends[k][0] != _source(recvs[k][0]):
            recv, _, where = recvs[k]
            raise self.fail(channel[1], recv, f"message {k} from rank {channel[0]} is {sends[k][0]!r}: sends and "
                                              "receives between two ranks must be posted in the same order", where)
        return a, channel, k, when

    def finish(self, r: int) -> float | None:
        """Batched: when rank r's posted batch completes; None while it waits."""
        end, lag = self.clock[r], self.costs.comm
        for a, channel, k, t in self.pending[r] or []:
            other = self.sends if a.kind in (RECV_F, RECV_B) else self.recvs
            queue = other.get(channel, [])
            if len(queue) <= k:
                return None
            end = max(end, max(t, queue[k][1]) + lag)
        return end

    def waits(self, r: int) -> str:
        """What rank r waits for."""
        out = []
        for a, (src, dst), k, _ in self.pending[r] or []:
            if a.kind in (RECV_F, RECV_B) and len(self.sends.get((src, dst), [])) <= k:
                out.append(f"{a!r} waits for {_source(a)!r} from rank {src}")
            elif a.kind in (SEND_F, SEND_B) and len(self.recvs.get((src, dst), [])) <= k:
                out.append(f"{a!r} waits for rank {dst} to post its receive")
        acts = self.s.ranks[r]
        if self.pending[r] is None and acts[self.pos[r]].kind in COMPUTE:
            a = acts[self.pos[r]]
            out += [f"{a!r} waits for {_source(d)!r} from rank {self.s.peer(d)}"
                    for d in self.inputs(r, a) if d in self.posted[r]]
        return "; ".join(out)

    def advance(self, r: int) -> bool:
        """Run rank r as far as it can go; True if it moved."""
        acts, moved = self.s.ranks[r], False
        while self.pos[r] < len(acts):
            a = acts[self.pos[r]]
            if a.kind in COMPUTE:
                if not self.compute(r, a):
                    return moved
            elif not self.batched:  # posted; a RECV's data is waited for by the compute that uses it
                posted = self.post(r, a, self.pos[r])
                if a.kind in (RECV_F, RECV_B):
                    self.posted[r][a] = posted, len(self.events[r])
                else:
                    self.done[a] = posted[3]
                self.events[r].append((posted[3], posted[3], a))
            else:
                if self.pending[r] is None:
                    stop = self.pos[r] + 1
                    while stop < len(acts) and acts[stop].kind not in COMPUTE:
                        stop += 1
                    self.pending[r] = [self.post(r, c, i) for i, c in enumerate(acts[self.pos[r]:stop], self.pos[r])]
                    moved = True
                end = self.finish(r)
                if end is None:
                    return moved
                batch = self.pending[r] or []
                for c, _, _, t in batch:
                    self.done[c] = end
                    self.events[r].append((t, end, c))
                self.pos[r] += len(batch) - 1
                self.clock[r], self.pending[r] = end, None
            self.pos[r] += 1
            moved = True
        return moved

    def run(self) -> Simulation:
        ranks = range(self.s.pp)
        while any(self.pos[r] < len(self.s.ranks[r]) for r in ranks):
            if not any([self.advance(r) for r in ranks]):
                stuck = [f"rank {r} at action {self.pos[r]}: {self.waits(r)}"
                         for r in ranks if self.pos[r] < len(self.s.ranks[r])]
                raise ScheduleError(f"{self.head} deadlocks:\n  " + "\n  ".join(stuck))
        self.check_complete()
        makespan = max(self.clock)
        return Simulation(makespan, tuple(
            RankStats(self.clock[r], self.busy[r], 1 - self.busy[r] / makespan if makespan else 0.0,
                      self.peak[r], tuple(self.events[r]), frozenset(self.crowds[r]),
                      frozenset(self.backward_crowds[r])) for r in ranks))

    def check_complete(self) -> None:
        for channel, queue in self.sends.items():
            received = len(self.recvs.get(channel, []))
            if received < len(queue):
                raise ScheduleError(f"{self.head}: {queue[received][0]!r} from rank {channel[0]} "
                                    "is never received")
        for s in range(self.s.stages):
            for m in range(self.s.m):
                for kind in (F, B):
                    if Action(kind, s, m) not in self.done:
                        raise ScheduleError(f"{self.head}: {Action(kind, s, m)!r} never runs")


def simulate(schedule: Schedule, costs: Costs = Costs(), batched: bool = False,
             release: str = "W", durations: dict[Action, float] | None = None, early: bool = True) -> Simulation:
    """Check and time a schedule. release says when a (stage, micro) stops counting as in flight: at its
    B, or at its W ("W", the default, since W still needs the saved input; a B with no W releases). durations:
    compute actions' own costs in place of costs', to replay a measured run: a B with no W in the schedule
    holds both, or with a W duration of its own (the runtime traces an early sender's apart) its input gradient.
    early: as the runtime, B actions in Schedule.sends_early send before their weight gradient; False: every B
    is one block, the model of the papers' bubble formulas."""
    if release not in ("B", "W"):
        raise ValueError(f"release={release!r} must be 'B' or 'W'")
    return _Run(schedule, costs, batched, release, durations, early).run()
