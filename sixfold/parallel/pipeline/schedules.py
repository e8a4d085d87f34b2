"""Pipeline schedules as data: per-rank lists of actions, built by pure functions of (pp, v, m).

The model's layers are split into pp * v stages. An action names a stage held by the rank that runs it:
  F(s, m)       forward of micro-batch m through stage s
  B(s, m)       backward: the input gradient, and the weight gradient too unless a W(s, m) follows (then
                after sending the input gradient, Schedule.sends_early)
  W(s, m)       the deferred weight gradient of an earlier B(s, m)
  SEND_F(s, m)  send F(s, m)'s output to the rank of stage s + 1   (matches RECV_F(s + 1, m))
  RECV_F(s, m)  receive F(s, m)'s input from the rank of stage s - 1
  SEND_B(s, m)  send B(s, m)'s input gradient to the rank of stage s - 1   (matches RECV_B(s - 1, m))
  RECV_B(s, m)  receive B(s, m)'s output gradient from the rank of stage s + 1
Neighbouring stages on the same rank pass data locally, with no send or receive.

A schedule function gives each rank's compute order; build() adds the communication. A SEND goes right
after the compute that produced it. Its RECV goes where the receiver stands when the message is sent on
the unit-cost timeline: right before the compute that needs it when the receiver is waiting for it, earlier
when it arrives while the receiver works on something else (looped and V placements, where rendezvous
sends and receives posted only just in time would wait on each other in a ring). So the sends and receives
between two computes form one run, which the runtime may post as one batch_isend_irecv, and a rank
receives from another in the order that one sends (NCCL matches by order). The RECV is where to post the
receive; the runtime need not wait for it until the compute that uses it.
simulate.py checks every schedule here: matched and ordered messages, dependencies, no deadlock with or
without batching.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...config import ConfigError

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)


@dataclass(frozen=True)
class Action:
    kind: str
    stage: int
    micro: int

    def __repr__(self) -> str:
        return f"{self.kind}(s{self.stage},m{self.micro})"


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    v: int
    m: int
    placement: tuple[int, ...]  # rank of each stage
    ranks: tuple[tuple[Action, ...], ...]  # the actions of each rank, in order

    @property
    def stages(self) -> int:
        return self.pp * self.v

    def peer(self, action: Action) -> int:
        """The rank a SEND goes to or a RECV comes from."""
        step = 1 if action.kind in (SEND_F, RECV_B) else -1
        return self.placement[action.stage + step]

    @property
    def splits(self) -> bool:
        """Whether the schedule has W actions (its B's compute input gradients only)."""
        return any(a.kind == W for acts in self.ranks for a in acts)

    def split(self, rank: int) -> set[tuple[int, int]]:
        """(stage, micro) of the rank's B actions with a W of their own (which defer their weight gradients to it)."""
        return {(a.stage, a.micro) for a in self.ranks[rank] if a.kind == W}

    def sends_early(self, rank: int) -> set[tuple[int, int]]:
        """(stage, micro) of the rank's B actions that send their input gradient before their weight gradient:
        those with no W of their own whose previous stage is on another rank. The runtime defers their weight
        gradient as for a W and computes it right after posting the send, so the peer's backward starts sooner."""
        acts, split = self.ranks[rank], self.split(rank)
        return {(a.stage, a.micro) for a in acts if a.kind == B and a.stage > 0 and
                self.placement[a.stage - 1] != rank and (a.stage, a.micro) not in split}

    def __str__(self) -> str:
        head = f"{self.name} pp={self.pp} v={self.v} m={self.m}, stage ranks {list(self.placement)}"
        rows = [f"rank {r}: " + " ".join(map(repr, acts)) for r, acts in enumerate(self.ranks)]
        return "\n".join([head] + rows)


def placement(pp: int, v: int, schedule: str = "1f1b") -> list[int]:
    """Rank of each of the pp * v stages: looped, rank r holding stages r, r + pp, r + 2pp, ...;
    or for zb-v (v = 2) a V, rank r holding stages r and 2pp-1-r."""
    if schedule == "zb-v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * v)]


def _deps(a: Action, last: int) -> list[Action]:
    """The compute actions that a compute action needs first."""
    s, m = a.stage, a.micro
    if a.kind == F:
        return [Action(F, s - 1, m)] if s > 0 else []
    if a.kind == B:
        return [Action(F, s, m)] + ([Action(B, s + 1, m)] if s < last else [])
    return [Action(B, s, m)]


def _timeline(orders: list[list[Action]], last: int) -> dict[Action, tuple[float, float]]:
    """Start and end of every compute action, each run as soon as it can at unit costs
    (F = B = W = 1, and B = 2 where it also computes the weight gradient)."""
    split = {(a.stage, a.micro) for order in orders for a in order if a.kind == W}
    times: dict[Action, tuple[float, float]] = {}
    pos, clock = [0] * len(orders), [0.0] * len(orders)
    while any(p < len(o) for p, o in zip(pos, orders)):
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                deps = _deps(a, last)
                if any(d not in times for d in deps):
                    break
                start = max([clock[r]] + [times[d][1] for d in deps])
                clock[r] = start + (2 if a.kind == B and (a.stage, a.micro) not in split else 1)
                times[a] = (start, clock[r])
                pos[r] += 1
                moved = True
        if not moved:
            stuck = [order[p] for p, order in zip(pos, orders) if p < len(order)]
            raise RuntimeError(f"compute orders wait on each other at {stuck}")
    return times


def _with_comms(orders: list[list[Action]], where: list[int]) -> tuple[tuple[Action, ...], ...]:
    """Add the sends and receives between ranks: each SEND right after its compute, each RECV before the
    receiver's first compute that starts no earlier than the message is sent (see the module docstring)."""
    last = len(where) - 1
    times = _timeline(orders, last)
    sends: dict[Action, Action] = {}
    inbox: list[list[tuple[float, Action]]] = [[] for _ in orders]  # (sent at, RECV) for each receiver
    for r, order in enumerate(orders):
        for a in order:
            s, m, t = a.stage, a.micro, times[a][1]
            if a.kind == F and s < last and where[s + 1] != r:
                sends[a] = Action(SEND_F, s, m)
                inbox[where[s + 1]].append((t, Action(RECV_F, s + 1, m)))
            if a.kind == B and s > 0 and where[s - 1] != r:
                sends[a] = Action(SEND_B, s, m)
                inbox[where[s - 1]].append((t, Action(RECV_B, s - 1, m)))
    ranks = []
    for r, order in enumerate(orders):
        waiting, k = sorted(inbox[r], key=lambda x: x[0]), 0
        acts = []
        for a in order:
            while k < len(waiting) and waiting[k][0] <= times[a][0]:
                acts.append(waiting[k][1])
                k += 1
            acts.append(a)
            if a in sends:
                acts.append(sends[a])
        ranks.append(tuple(acts))
    return tuple(ranks)


def gpipe(pp: int, v: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards (AFAB)."""
    return [[Action(F, r, i) for i in range(m)] + [Action(B, r, i) for i in range(m)] for r in range(pp)]


def one_f_one_b(pp: int, v: int, m: int) -> list[list[Action]]:
    """pp-1-rank warm-up forwards, then one forward one backward, then the remaining backwards."""
    orders = []
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        order = [Action(F, r, i) for i in range(warm)]
        for i in range(m - warm):
            order += [Action(F, r, warm + i), Action(B, r, i)]
        orders.append(order + [Action(B, r, i) for i in range(m - warm, m)])
    return orders


def interleaved(pp: int, v: int, m: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B (looped placement): micro-batches in groups of pp go through each local
    stage in turn; rank r warms up with 2(pp-1-r) + (v-1)pp forwards, then alternates, then drains."""
    total = m * v

    def unit(r: int, k: int, kind: str) -> Action:
        chunk = (k // pp) % v
        if kind == B:
            chunk = v - 1 - chunk
        return Action(kind, chunk * pp + r, (k // (pp * v)) * pp + k % pp)

    orders = []
    for r in range(pp):
        warm = min(2 * (pp - 1 - r) + (v - 1) * pp, total)
        order = [unit(r, k, F) for k in range(warm)]
        for k in range(total - warm):
            order += [unit(r, warm + k, F), unit(r, k, B)]
        orders.append(order + [unit(r, k, B) for k in range(total - warm, total)])
    return orders


def breadth_first(pp: int, v: int, m: int) -> list[list[Action]]:
    """Breadth-first (Lamy-Poirier 2023), looped placement: every micro-batch goes through a local stage
    before the next local stage; all forwards, then all backwards in reverse stage order."""
    orders = []
    for r in range(pp):
        local = range(r, pp * v, pp)
        order = [Action(F, s, i) for s in local for i in range(m)]
        orders.append(order + [Action(B, s, i) for s in reversed(local) for i in range(m)])
    return orders


def zb_h1(pp: int, v: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023): 1F1B with each backward split into B and W. Rank r runs the W of micro-batch
    i after the B of micro-batch i + r, so B reaches the first rank sooner and the deferred W's fill the
    cool-down. Saved activations until B as in 1F1B; until W, at most pp on every rank."""
    orders = []
    for r, order in enumerate(one_f_one_b(pp, v, m)):
        split = []
        for a in order:
            split.append(a)
            if a.kind == B and a.micro >= r:
                split.append(Action(W, r, a.micro - r))
        orders.append(split + [Action(W, r, i) for i in range(max(m - r, 0), m)])
    return orders


def zb_v(pp: int, v: int, m: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2023, section 6): rank r holds stages r and 2pp-1-r, so the loss is on rank 0;
    B and W split. Warm-up fills the V with forwards, the steady phase runs F B W on both stages, the
    cool-down fills with W's. Built for at least 2pp-1 micro-batches, the extra ones then dropped; with no more
    micro-batches than ranks, whose dropped slots would leave much of the V idle, filled greedily (_fill_v)."""
    if m <= pp:
        return _fill_v(pp, m)
    n = max(m, 2 * pp - 1)
    orders = []
    for r in range(pp):
        first, second = r, 2 * pp - 1 - r  # this rank's stage on each arm of the V
        done: dict[tuple[str, int], int] = {}
        order: list[Action] = []

        def put(*steps: tuple[str, int]) -> None:
            for kind, s in steps:
                i = done.get((kind, s), 0)
                done[kind, s] = i + 1
                order.append(Action(kind, s, i))

        put(*[(F, first)] * (2 * (pp - r) - 1))
        put(*[(F, second), (F, first)] * r)
        put(*[(F, second), (B, second), (W, second)] * (pp - r))
        while done[F, second] < n:
            if done[F, first] < n:
                put((F, first))
            put((B, first), (W, first), (F, second), (B, second), (W, second))
        put(*[(B, first), (B, second)] * r)
        put(*[(B, first), (W, first)] * (pp - r))
        put(*[(W, second)] * (n - done[W, second]) + [(W, first)] * (n - done[W, first]))
        orders.append([a for a in order if a.micro < m])
    return orders


def _fill_v(pp: int, m: int) -> list[list[Action]]:
    """ZB-V's V filled greedily at unit costs: whenever free, a rank runs the first ready of a B (of its first stage
    first), an F (of its second stage first) and a W. With m <= pp a rank holds at most 1F1B's 2pp pairs, and at
    m = pp each rank idles pp - 1 units, the least possible (the V built as for 2pp - 1 idles more: 6 at pp = 4)."""
    last = 2 * pp - 1
    ends: dict[Action, int] = {}
    counts: dict[tuple[str, int], int] = {}
    orders: list[list[Action]] = [[] for _ in range(pp)]
    t = 0
    while len(ends) < 6 * pp * m:
        for r, order in enumerate(orders):
            first, second = r, last - r
            steps = [(B, first), (B, second), (F, second), (F, first), (W, first), (W, second)]
            ready = [Action(kind, s, counts.get((kind, s), 0)) for kind, s in steps if counts.get((kind, s), 0) < m]
            ready = [a for a in ready if all(ends.get(d, t + 1) <= t for d in _deps(a, last))]
            if ready:
                a = ready[0]
                ends[a], counts[a.kind, a.stage] = t + 1, a.micro + 1
                order.append(a)
        t += 1
    return orders


SCHEDULES: dict[str, Callable[[int, int, int], list[list[Action]]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "breadth-first": breadth_first,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
}


def check_name(name: str) -> None:
    if name not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={name!r} is not one of {', '.join(SCHEDULES)}")


LEAST_V = {"interleaved": 2, "zb-v": 2}  # the fewest virtual stages per rank a schedule runs (others: 1)


def check(name: str, pp: int, v: int, m: int, sequences: int | None = None) -> None:
    """Raise ConfigError, naming the setting to change, where a schedule cannot run (pp, v, m); `sequences`: a
    data-parallel rank's per step, if known, which the micro-batch count must divide."""
    check_name(name)
    for key, value in (("parallel.pp", pp), ("parallel.pp_virtual_stages", v), ("train.micro_batches", m)):
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    if name in ("gpipe", "1f1b", "zb-h1") and v != 1:
        raise ConfigError(
            f"parallel.pp_schedule={name!r} runs one stage per rank: set parallel.pp_virtual_stages=1 "
            f"(got {v}), or choose 'interleaved', 'breadth-first' or 'zb-v'")
    if name == "interleaved":
        if v < LEAST_V[name]:
            raise ConfigError(
                f"parallel.pp_schedule='interleaved' needs parallel.pp_virtual_stages >= 2 (got {v}); "
                "with one stage per rank use '1f1b'")
        if m % pp:
            fits = [k for k in range(pp, sequences + 1, pp) if sequences % k == 0] if sequences else []
            fix = f"set train.micro_batches to {(m // pp + 1) * pp} (or another multiple)" if sequences is None else \
                f"set train.micro_batches to {' or '.join(map(str, fits[:3]))}" if fits else \
                f"no multiple of {pp} divides the {sequences} sequence(s) per data-parallel rank (train.global_batch " \
                f"/ dp): change train.global_batch or parallel.pp"
            raise ConfigError(f"parallel.pp_schedule='interleaved' needs train.micro_batches={m} to be a multiple of "
                              f"parallel.pp={pp}: {fix}, or choose another schedule")
    if name == "zb-v" and v != LEAST_V[name]:
        raise ConfigError(
            f"parallel.pp_schedule='zb-v' places 2 stages per rank in a V: set parallel.pp_virtual_stages=2 "
            f"(got {v})")


def build(name: str, pp: int, v: int, micro_batches: int) -> Schedule:
    """The named schedule for pp ranks, v stages per rank and the given number of micro-batches."""
    check(name, pp, v, micro_batches)
    where = placement(pp, v, name)
    orders = SCHEDULES[name](pp, v, micro_batches)
    return Schedule(name, pp, v, micro_batches, tuple(where), _with_comms(orders, where))
