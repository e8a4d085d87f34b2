"""The six-dimensional mesh: pure rank arithmetic (ParallelDims) and its process groups (ParallelContext).

Ranks vary fastest along tp, then cp, dp_shard, dp_replicate, pp (docs/guide/README.md, "The mesh in one paragraph").
Expert parallel borrows ranks: an ep group is `ep` consecutive members of the flattened
(dp_shard, cp) index; edp is the rest of (dp_replicate, dp_shard, cp). pp_ends joins the first and last
pipeline ranks (a tied embedding and head), every other rank alone.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property

import torch
import torch.distributed as dist

from .config import ConfigError, ParallelConfig, check_world_size
from .errors import PeerStopped, collective, on_every_rank
from .heartbeat import PeerFailed, PeerLost, in_turn
from .join import job_world, join_job, leave_job, pick_device
from .launch import under_torchrun
from .rollcall import RollCall

ORDER = ("tp", "cp", "dp_shard", "dp_replicate", "pp")  # innermost first

# group name -> mesh dimensions whose ranks vary inside the group
GROUP_DIMS = {
    "tp": ("tp",),
    "cp": ("cp",),
    "pp": ("pp",),
    "fsdp": ("dp_shard", "cp"),
    "dp_replicate": ("dp_replicate",),
    "batch": ("dp_replicate", "dp_shard"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
    "world": ORDER,
}
GROUP_NAMES = tuple(GROUP_DIMS) + ("ep", "edp", "pp_ends")
# groups that sum a few numbers the host holds, at a step's start and end, over a twin of their own on gloo: whatever
# bulk work the group's own process group (in many layouts the same as fsdp's or dp's) has queued, they need not
# wait behind it, nor for the device
HOST_GROUPS = ("world", "loss")


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ORDER + ("ep",):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be at least 1")
        if (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} must divide parallel.dp_shard*parallel.cp="
                              f"{self.dp_shard * self.cp} (expert parallel borrows those ranks)")

    @classmethod
    def from_config(cls, p: ParallelConfig) -> "ParallelDims":
        return cls(p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp, p.ep)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    def _strides(self) -> dict[str, int]:
        strides, s = {}, 1
        for name in ORDER:
            strides[name] = s
            s *= getattr(self, name)
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        """Rank of `rank` along each dimension (ep and edp included)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        st = self._strides()
        c = {name: (rank // st[name]) % getattr(self, name) for name in ORDER}
        flat = c["dp_shard"] * self.cp + c["cp"]
        c["ep"] = flat % self.ep
        c["edp"] = c["dp_replicate"] * (self.dp_shard * self.cp // self.ep) + flat // self.ep
        return c

    def rank_of(self, coords: dict[str, int]) -> int:
        st = self._strides()
        return sum(coords[name] * st[name] for name in ORDER)

    def group_ranks(self, name: str, rank: int) -> tuple[int, ...]:
        """The ranks of group `name` that contains `rank`, in group-rank order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return self._group_of(name)[rank]

    @functools.lru_cache(maxsize=None)
    def _group_of(self, name: str) -> list[tuple[int, ...]]:
        """rank -> its group of kind `name`."""
        out: list[tuple[int, ...]] = [()] * self.world_size
        for group in self.all_groups(name):
            for r in group:
                out[r] = group
        return out

    @functools.lru_cache(maxsize=None)  # the planner asks for every group of every stage of every layout
    def all_groups(self, name: str) -> tuple[tuple[int, ...], ...]:
        """Every group of kind `name`, a partition of the world, by first rank; each in group-rank order (rising)."""
        ranks = torch.arange(self.world_size).view([getattr(self, d) for d in reversed(ORDER)])
        if name in ("ep", "edp"):  # [pp, dp_replicate, dp_shard * cp / ep, ep, tp]
            ranks = ranks.flatten(2, 3).unflatten(2, (-1, self.ep))
            vary = (3,) if name == "ep" else (1, 2)
        elif name == "pp_ends":  # the first and last stages' ranks paired, the middle ones alone
            ends = ranks[sorted({0, self.pp - 1})].flatten(1).T
            middle = ranks[1:self.pp - 1].reshape(-1, 1)
            return tuple(sorted((tuple(g.tolist()) for g in (*ends, *middle)), key=lambda g: g[0]))
        elif name in GROUP_DIMS:
            vary = tuple(sorted(ORDER[::-1].index(d) for d in GROUP_DIMS[name]))
        else:
            raise KeyError(f"unknown group '{name}'; groups are {', '.join(GROUP_NAMES)}")
        keep = [d for d in range(ranks.dim()) if d not in vary]
        groups = ranks.permute(*keep, *vary).reshape(-1, math.prod(ranks.shape[d] for d in vary))
        return tuple(sorted((tuple(g.tolist()) for g in groups), key=lambda g: g[0]))

    @functools.lru_cache(maxsize=None)
    def crosses_nodes(self, name: str, per_node: int) -> bool:
        """Whether some group of kind `name` holds ranks of two nodes, ranks filling nodes of `per_node` in order."""
        return any(g[0] // per_node != g[-1] // per_node for g in self.all_groups(name))


class Groups:
    """The process groups of a running job by their ranks, each rank set made once. dist.new_group must be
    called by every rank of the job for every group, members or not, in the same order: so every rank asks
    for the same layouts in the same order."""

    def __init__(self, timeout: timedelta, made: dict[tuple[int, ...], dist.ProcessGroup] | None = None):
        self.timeout = timeout
        self.made = dict(made or {})
        self.host: dict[tuple[int, ...], dist.ProcessGroup] = {}  # HOST_GROUPS' twins on gloo, by ranks

    def make(self, dims: ParallelDims) -> None:
        """Every group of `dims` on the job's first dims.world_size ranks, made if new, and the host twins of
        HOST_GROUPS (ParallelContext.host)."""
        for names, made, backend in ((GROUP_NAMES, self.made, None), (HOST_GROUPS, self.host, "gloo")):
            for ranks in (ranks for name in names for ranks in dims.all_groups(name)):
                if len(ranks) > 1 and ranks not in made:
                    made[ranks] = dist.new_group(list(ranks), timeout=self.timeout, backend=backend)

    def named(self, dims: ParallelDims, rank: int) -> dict[str, dist.ProcessGroup | None]:
        """The named groups that hold `rank` (None for a group of one); make(dims) first."""
        return {name: self.made.get(dims.group_ranks(name, rank)) for name in GROUP_NAMES}

    def named_host(self, dims: ParallelDims, rank: int) -> dict[str, dist.ProcessGroup | None]:
        """The host twins of HOST_GROUPS that hold `rank` (None for a group of one); make(dims) first."""
        return {name: self.host.get(dims.group_ranks(name, rank)) for name in HOST_GROUPS}


class ParallelContext:
    """Ranks, named process groups and the device of one process; built once and passed around."""

    def __init__(self, dims: ParallelDims, rank: int, backend: str, device: torch.device,
                 groups: dict[str, dist.ProcessGroup | None], job: bool = False, timeout: timedelta | None = None,
                 roll_call: RollCall | None = None, host: dict[str, dist.ProcessGroup | None] | None = None):
        self.dims, self.rank, self.backend, self.device = dims, rank, backend, device
        self.groups = groups
        self.host = host or {name: None for name in HOST_GROUPS}  # HOST_GROUPS' twins (Groups.make)
        self.job = job  # this process joined the job itself (not a layout inside sixfold.multirun's)
        self.timeout = timeout  # parallel.timeout_s, where this process joined the job
        self.roll_call = roll_call  # there too: a failed collective names the ranks to look at
        self.coords = dims.coords(rank)
        self._members = {name: dims.group_ranks(name, rank) for name in GROUP_NAMES}

    @classmethod
    def single(cls, dims: ParallelDims | None = None) -> "ParallelContext":
        dims = dims or ParallelDims()
        backend, device = pick_device()
        return cls(dims, 0, backend, device, {name: None for name in GROUP_NAMES})

    @classmethod
    def initialize(cls, parallel: ParallelConfig) -> "ParallelContext":
        """Join the torchrun job (if any) and build every named group, deduplicated."""
        dims = ParallelDims.from_config(parallel)
        world = job_world()
        try:
            n = parallel.world_size
            check_world_size(parallel, world, remedy=f"start {n} rank{'s' if n > 1 else ''} in all (torchrun's "
                             f"--nnodes times --nproc-per-node)" if under_torchrun() else "")
        except ConfigError as e:
            raise on_every_rank(e) from None
        if world == 1:
            return cls.single(dims)
        timeout = timedelta(seconds=parallel.timeout_s)
        rank, roll_call = join_job(timeout)
        backend, device = pick_device()
        groups = Groups(timeout, {tuple(range(world)): dist.group.WORLD})
        groups.make(dims)
        return cls(dims, rank, backend, device, groups.named(dims, rank), job=True, timeout=timeout,
                   roll_call=roll_call, host=groups.named_host(dims, rank))

    @classmethod
    def inside(cls, dims: ParallelDims, groups: Groups) -> "ParallelContext | None":
        """A layout on the first dims.world_size ranks of a running job, its groups sub-groups of the job
        (made by `groups`, once per rank set). Every rank of the job calls it, in the same order; a rank outside
        the layout gets None. Layout ranks are job ranks, so point-to-point peers need no translation."""
        groups.make(dims)
        rank = dist.get_rank()
        if rank >= dims.world_size:
            return None
        backend, device = pick_device()
        return cls(dims, rank, backend, device, groups.named(dims, rank), host=groups.named_host(dims, rank))

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def members(self, name: str) -> tuple[int, ...]:
        return self._members[name]

    def size(self, name: str) -> int:
        return len(self._members[name])

    def rank_in(self, name: str) -> int:
        return self._members[name].index(self.rank)

    @cached_property
    def batch_index(self) -> int:
        """Which slice of the global batch this rank reads."""
        return self.rank_in("batch")

    def all_gather_objects(self, obj, group: str = "world") -> list:
        """Every member's `obj` (pickled in transit), on every member."""
        if self.size(group) == 1:
            return [obj]
        out = [None] * self.size(group)
        with collective(f"all_gather_object {group}", self.members(group), roll_call=self.roll_call):
            dist.all_gather_object(out, obj, group=self.groups[group])
        return out

    def first_problem(self, problem: str) -> str:
        """The first non-empty `problem` (a refusal, a failure) of any rank, on every rank: all stop together."""
        return next((p for p in self.all_gather_objects(problem) if p), "")

    def barrier(self) -> None:
        if self.world_size > 1:
            with collective("barrier world", range(self.world_size), roll_call=self.roll_call):
                dist.barrier(group=self.groups["world"])

    def local_first(self, fn):
        """fn() on each machine's first rank, then on the other ranks; returns once every rank has run it. However
        long fn() takes (a first rank tokenizing a large corpus), the ranks check in with each other every third of
        parallel.timeout_s (heartbeat.py). A rank that fails, dies or stops answering for parallel.timeout_s (its
        process or machine gone or frozen) stops the ranks waiting and those still running fn(). In one process or
        inside sixfold.multirun's job, fn() at once."""
        if not self.job or self.world_size == 1:
            return fn()
        first = int(os.environ.get("LOCAL_RANK", 0)) == 0
        out = self._in_turn(fn, first, "the machines' first ranks to run")
        later = self._in_turn(fn, not first, "the other ranks to run")
        return out if first else later

    def main_alone(self, fn, what: str):
        """fn() on rank 0 (None elsewhere); returns once it has run. The others wait however long it takes, checking
        in as local_first's do (`what`: fn's work, for their message should rank 0 stop answering)."""
        if not self.job or self.world_size == 1:
            return fn() if self.is_main else None
        return self._in_turn(fn, self.is_main, what)

    def all_at_once(self, fn, what: str):
        """fn() on every rank; returns once every rank has run it. Those done first wait however long the others
        take, checking in as local_first's do (`what`: fn's work, for their message should a rank stop answering)."""
        if not self.job or self.world_size == 1:
            return fn()
        return self._in_turn(fn, True, what)

    def _in_turn(self, fn, mine: bool, what: str):
        stopped = f"rank {self.rank} stopped " + (f"(one of {what})" if mine else f"waiting for {what}")
        try:
            return in_turn(self.host["world"], fn, mine, self.timeout.total_seconds() / 3)
        except PeerFailed as e:
            raise PeerStopped(f"{stopped}: {e} (see its log)") from None
        except PeerLost as e:
            raise PeerStopped(f"{stopped}: another rank died or did not answer within parallel.timeout_s "
                              f"({self.timeout.total_seconds():g} s): {e}") from None

    def close(self) -> None:
        """Drop our references to the process groups and leave the job."""
        self.groups = {name: None for name in self.groups}
        self.host = {name: None for name in self.host}
        leave_job()
