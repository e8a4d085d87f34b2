"""Pipeline schedules as data: per-rank lists of actions, built by pure functions of (pp, v, m).

The model's layers are split into pp * v stages. An action names a stage held by the rank that runs it:
  F(s, m)       forward of micro-batch m through stage s
  B(s, m)       backward: the input gradient, and the weight gradient too unless a W(s, m) follows
  W(s, m)       the deferred weight gradient of an earlier B(s, m)
  SEND_F(s, m)  send F(s, m)'s output to the rank of stage s + 1   (matches RECV_F(s + 1, m))
  RECV_F(s, m)  receive F(s, m)'s input from the rank of stage s - 1
  SEND_B(s, m)  send B(s, m)'s input gradient to the rank of stage s - 1   (matches RECV_B(s - 1, m))
  RECV_B(s, m)  receive B(s, m)'s output gradient from the rank of stage s + 1
A RECV sits right before the compute that needs it and a SEND right after the compute that produced it,
so the communication between two computes is one run that the runtime may post as one batch.
Neighbouring stages on the same rank pass data locally, with no send or receive.
simulate.py checks every schedule here: matched and ordered messages, dependencies, no deadlock.
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

    def __str__(self) -> str:
        head = f"{self.name} pp={self.pp} v={self.v} m={self.m}, stage ranks {list(self.placement)}"
        rows = [f"rank {r}: " + " ".join(map(repr, acts)) for r, acts in enumerate(self.ranks)]
        return "\n".join([head] + rows)


def placement(pp: int, v: int, schedule: str = "1f1b") -> list[int]:
    """Rank of each of the pp * v stages: looped (stage s on rank s % pp), or a V for zb-v."""
    if schedule == "zb-v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * v)]


def _with_comms(orders: list[list[Action]], where: list[int]) -> tuple[tuple[Action, ...], ...]:
    """Insert the sends and receives that the compute orders need between ranks."""
    last = len(where) - 1
    ranks = []
    for r, order in enumerate(orders):
        acts = []
        for a in order:
            s, m = a.stage, a.micro
            if a.kind == F and s > 0 and where[s - 1] != r:
                acts.append(Action(RECV_F, s, m))
            if a.kind == B and s < last and where[s + 1] != r:
                acts.append(Action(RECV_B, s, m))
            acts.append(a)
            if a.kind == F and s < last and where[s + 1] != r:
                acts.append(Action(SEND_F, s, m))
            if a.kind == B and s > 0 and where[s - 1] != r:
                acts.append(Action(SEND_B, s, m))
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
    """Megatron's interleaved 1F1B: micro-batches in groups of pp go through each local stage in turn."""
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
    """Looped: every micro-batch through a local stage before the next one; forwards, then backwards."""
    orders = []
    for r in range(pp):
        local = range(r, pp * v, pp)
        order = [Action(F, s, i) for s in local for i in range(m)]
        orders.append(order + [Action(B, s, i) for s in reversed(local) for i in range(m)])
    return orders


SCHEDULES: dict[str, Callable[[int, int, int], list[list[Action]]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "breadth-first": breadth_first,
}


def check(name: str, pp: int, v: int, m: int) -> None:
    """Raise ConfigError, naming the setting to change, where a schedule cannot run (pp, v, m)."""
    if name not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={name!r} is not one of {', '.join(SCHEDULES)}")
    for key, value in (("parallel.pp", pp), ("parallel.pp_virtual_stages", v), ("train.micro_batches", m)):
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    if name in ("gpipe", "1f1b", "zb-h1") and v != 1:
        raise ConfigError(
            f"parallel.pp_schedule={name!r} runs one stage per rank: set parallel.pp_virtual_stages=1 "
            f"(got {v}), or choose 'interleaved', 'breadth-first' or 'zb-v'")
    if name == "interleaved":
        if v < 2:
            raise ConfigError(
                f"parallel.pp_schedule='interleaved' needs parallel.pp_virtual_stages >= 2 (got {v}); "
                "with one stage per rank use '1f1b'")
        if m % pp:
            raise ConfigError(
                f"parallel.pp_schedule='interleaved' needs train.micro_batches={m} to be a multiple of "
                f"parallel.pp={pp}: set train.micro_batches to {(m // pp + 1) * pp}, or choose another schedule")
    if name == "zb-v" and v != 2:
        raise ConfigError(
            f"parallel.pp_schedule='zb-v' places 2 stages per rank in a V: set parallel.pp_virtual_stages=2 "
            f"(got {v})")


def build(name: str, pp: int, v: int, m: int) -> Schedule:
    """The named schedule for pp ranks, v stages per rank and m micro-batches."""
    check(name, pp, v, m)
    where = placement(pp, v, name)
    return Schedule(name, pp, v, m, tuple(where), _with_comms(SCHEDULES[name](pp, v, m), where))
