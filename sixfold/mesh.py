"""The six-dimensional mesh: pure rank arithmetic (ParallelDims) and its process groups (ParallelContext).

Ranks vary fastest along tp, then cp, dp_shard, dp_replicate, pp (docs/guide/README.md, "The mesh in one paragraph").
Expert parallel borrows ranks: an ep group is `ep` consecutive members of the flattened
(dp_shard, cp) index; edp is the rest of (dp_replicate, dp_shard, cp). pp_ends joins the first and last
pipeline ranks (a tied embedding and head), every other rank alone.
"""
from __future__ import annotations

import contextlib
import gc
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before any group exists: its functions' default group would pin the world group

from .config import ConfigError, ParallelConfig, check_world_size
from .heartbeat import PeerFailed, PeerLost, in_turn
from .launch import under_torchrun

ORDER = ("tp", "cp", "dp_shard", "dp_replicate", "pp")  # innermost first
POST_EVERY_S = 1.0  # how often rank 0 posts a start's number again to the ranks that have not taken it

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


class CommError(RuntimeError):
    """A collective that failed or timed out; the message names its group and what to check."""

    def __init__(self, name: str, ranks: tuple[int, ...], error: Exception, hint: str = ""):
        super().__init__(f"{name} over ranks {list(ranks)} failed: {error}. " + (hint or (
            "A rank of that group crashed or did not reach the same collective within parallel.timeout_s; see its "
            "log")))


@contextlib.contextmanager
def collective(name: str, ranks, hint: str = ""):
    """The failure of the collective inside (a rank crashed, or a timeout) as a CommError naming it."""
    try:
        yield
    except CommError:
        raise
    except RuntimeError as e:  # torch.distributed's DistError too
        raise CommError(name, tuple(ranks), e, hint) from None


class PeerStopped(RuntimeError):
    """A rank stopped while the ranks ran a step in turn, because another failed, died or did not answer."""


def on_every_rank(error: Exception) -> Exception:
    """`error`, marked as raised alike by every rank (after an exchange of problems, or from values all ranks
    hold), or by every rank of a machine (from its command line and files): the command line prints it once a
    machine, from its first rank, not once a rank."""
    error.on_every_rank = True
    return error


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
        c = self.coords(rank)
        if name in ("ep", "edp"):
            return tuple(r for r in range(self.world_size) if self._same_expert_group(name, c, self.coords(r)))
        if name == "pp_ends":
            ends = {0, self.pp - 1}
            if c["pp"] not in ends:
                return (rank,)
            return tuple(r for r in self.group_ranks("pp", rank) if self.coords(r)["pp"] in ends)
        if name not in GROUP_DIMS:
            raise KeyError(f"unknown group '{name}'; groups are {', '.join(GROUP_NAMES)}")
        vary = GROUP_DIMS[name]
        return tuple(r for r in range(self.world_size)
                     if all(self.coords(r)[d] == c[d] for d in ORDER if d not in vary))

    def _same_expert_group(self, name: str, a: dict, b: dict) -> bool:
        if a["tp"] != b["tp"] or a["pp"] != b["pp"]:
            return False
        if name == "ep":
            return a["edp"] == b["edp"]
        return a["ep"] == b["ep"]

    def all_groups(self, name: str) -> list[tuple[int, ...]]:
        """Every group of kind `name`: a partition of the world."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(self.group_ranks(name, r), None)
        return list(seen)


def pick_device() -> tuple[str, torch.device]:
    """Backend and device, chosen once: NCCL + CUDA where GPUs exist, gloo + CPU otherwise."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return "nccl", torch.device("cuda", local)
    return "gloo", torch.device("cpu")


def _agent_store() -> bool:
    """Whether torchrun's agent hosts the job's store (then it outlives the ranks, through restarts)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _store(timeout: timedelta, rank: int = -1, world: int | None = None) -> dist.TCPStore:
    """The job's rendezvous store: the agent's, or rank 0's."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=rank == 0 and not _agent_store(), timeout=timeout)


def _attempt_store(store: dist.TCPStore, rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The store's keys for this start of the job: a restarted job must not read the addresses that the ranks it
    replaces left in the agent's store. Each start is numbered by its rank 0 and the number posted to each other
    rank, again every POST_EVERY_S until every rank has said it took it. A rank clears its post before it waits for
    one: a post left by a rank of an earlier start that ended before reading it is gone then. (By then every rank of
    the earlier start has ended: torchrun's c10d rendezvous restarts every machine's ranks before any starts again.
    TORCHELASTIC_RESTART_COUNT cannot number the starts: each machine's agent counts only the restarts it began.)"""
    if not _agent_store():
        return dist.PrefixStore("sixfold", store)  # a new store, rank 0's, each start
    posts = [f"sixfold/attempt_for/{r}" for r in range(1, world)]
    if rank == 0:
        attempt = store.add("sixfold/attempts", 1)
        took, begun, posted, pause = f"sixfold/attempt_{attempt}/took", time.monotonic(), -POST_EVERY_S, 0.01
        while posts and store.add(took, 0) < len(posts):
            now = time.monotonic()
            if now - begun > timeout.total_seconds():
                raise RuntimeError(f"only {store.add(took, 0)} of the other {len(posts)} ranks took rank 0's number "
                                   f"for this start within parallel.timeout_s")
            if now - posted >= POST_EVERY_S:
                store.multi_set(posts, [str(attempt)] * len(posts))
                posted = now
            time.sleep(pause)
            pause = min(2 * pause, 0.2)  # light on the store while ranks are still starting
    else:
        post = posts[rank - 1]
        store.delete_key(post)
        try:
            store.wait([post])
        except dist.DistStoreError:
            raise RuntimeError("rank 0 did not number this start within parallel.timeout_s (it did not start, or "
                               "ended before joining)") from None
        attempt = int(store.get(post))
        store.add(f"sixfold/attempt_{attempt}/took", 1)
    return dist.PrefixStore(f"sixfold/attempt_{attempt}", store)


def first_done(first: bool, timeout: timedelta) -> bool:
    """Under torchrun, the machine's first rank marks in the job's store that it is done (`first`), and its other
    ranks wait for that mark, at most `timeout`: torchrun stops a machine's ranks once one has ended, so ending
    first they would stop it before it is done. The store is the agent's, which outlives the ranks; a mark is
    keyed by this machine and its agent and holds the time since boot it was made, so that one left by an earlier
    start (made before this process) is not taken for this one's. False if a rank that waited saw no mark."""
    if not _agent_store():
        return True
    key = f"sixfold/first_done/{socket.gethostname()}/{os.getppid()}"
    try:
        store = _store(timeout)
        if first:
            store.set(key, repr(time.clock_gettime(time.CLOCK_BOOTTIME)))
            return True
        started, deadline = _started(), time.monotonic() + timeout.total_seconds()
        store.wait([key])
        while float(store.get(key)) < started:  # an earlier start's
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True
    except dist.DistNetworkError:  # the agent and its store are gone: the job has ended
        return True
    except (RuntimeError, OSError, ValueError):  # DistStoreError (a timeout) is a RuntimeError
        return False


def _started() -> float:
    """When this process started, in seconds since boot; 0 where /proc does not say."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def join_job(timeout: timedelta) -> int:
    """Join the torchrun job (its world group); returns this process's rank."""
    backend, device = pick_device()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with collective(f"joining the job as rank {rank}", range(world), "Check MASTER_ADDR and MASTER_PORT (torchrun's "
                    "--rdzv-endpoint), and that every rank started within parallel.timeout_s; see their logs"):
        store = _attempt_store(_store(timeout, rank, world), rank, world, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    return rank


def leave_job() -> None:
    """Destroy every process group, and collect what still refers to one, so that each group's worker threads are
    joined now. A gloo worker that releases a finished collective's tensors after the interpreter has begun to exit
    needs the GIL and aborts the process ("terminate called without an active exception"); call this last, with
    no process group left referenced."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


class Groups:
    """The process groups of a running job by their ranks, each rank set made once. dist.new_group must be
    called by every rank of the job for every group, members or not, in the same order: so every rank asks
    for the same layouts in the same order."""

    def __init__(self, timeout: timedelta, made: dict[tuple[int, ...], dist.ProcessGroup] | None = None):
        self.timeout = timeout
        self.made = dict(made or {})

    def make(self, dims: ParallelDims) -> None:
        """Every group of `dims` on the job's first dims.world_size ranks, made if new."""
        for name in GROUP_NAMES:
            for ranks in dims.all_groups(name):
                if len(ranks) > 1 and ranks not in self.made:
                    self.made[ranks] = dist.new_group(list(ranks), timeout=self.timeout)

    def named(self, dims: ParallelDims, rank: int) -> dict[str, dist.ProcessGroup | None]:
        """The named groups that hold `rank` (None for a group of one); make(dims) first."""
        return {name: self.made.get(dims.group_ranks(name, rank)) for name in GROUP_NAMES}


class ParallelContext:
    """Ranks, named process groups and the device of one process; built once and passed around."""

    def __init__(self, dims: ParallelDims, rank: int, backend: str, device: torch.device,
                 groups: dict[str, dist.ProcessGroup | None], job: bool = False, timeout: timedelta | None = None):
        self.dims, self.rank, self.backend, self.device = dims, rank, backend, device
        self.groups = groups
        self.job = job  # this process joined the job itself (not a layout inside sixfold.multirun's)
        self.timeout = timeout  # parallel.timeout_s, where this process joined the job
        self._patient: dist.ProcessGroup | None = None
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
        world = int(os.environ.get("WORLD_SIZE", 1))
        try:
            check_world_size(parallel, world, remedy=f"start {parallel.world_size} ranks in all (torchrun's --nnodes "
                             f"times --nproc-per-node)" if under_torchrun() else "")
        except ConfigError as e:
            raise on_every_rank(e) from None
        if world == 1:
            return cls.single(dims)
        timeout = timedelta(seconds=parallel.timeout_s)
        rank = join_job(timeout)
        backend, device = pick_device()
        groups = Groups(timeout, {tuple(range(world)): dist.group.WORLD})
        groups.make(dims)
        return cls(dims, rank, backend, device, groups.named(dims, rank), job=True, timeout=timeout)

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
        return cls(dims, rank, backend, device, groups.named(dims, rank))

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
        with collective(f"all_gather_object {group}", self.members(group)):
            dist.all_gather_object(out, obj, group=self.groups[group])
        return out

    def first_problem(self, problem: str) -> str:
        """The first non-empty `problem` (a refusal, a failure) of any rank, on every rank: all stop together."""
        return next((p for p in self.all_gather_objects(problem) if p), "")

    def barrier(self) -> None:
        if self.world_size > 1:
            with collective("barrier world", range(self.world_size)):
                dist.barrier(group=self.groups["world"])

    def local_first(self, fn):
        """fn() on each machine's first rank, then on the other ranks; returns once every rank has run it. However
        long fn() takes (a first rank tokenizing a large corpus), the ranks check in with each other every third of
        parallel.timeout_s (heartbeat.py). A rank that fails, dies or stops answering for parallel.timeout_s (its
        process or machine gone or frozen) stops the ranks waiting and those still running fn(). In one process or
        inside sixfold.multirun's job, fn() at once."""
        if not self.job or self.world_size == 1:
            return fn()
        if self._patient is None:
            self._patient = dist.new_group(backend="gloo", timeout=self.timeout)
        first = int(os.environ.get("LOCAL_RANK", 0)) == 0
        out = self._in_turn(fn, first, "the machines' first ranks to run")
        later = self._in_turn(fn, not first, "the other ranks to run")
        return out if first else later

    def _in_turn(self, fn, mine: bool, what: str):
        stopped = f"rank {self.rank} stopped " + (f"(one of {what})" if mine else f"waiting for {what}")
        try:
            return in_turn(self._patient, fn, mine, self.timeout.total_seconds() / 3)
        except PeerFailed as e:
            raise PeerStopped(f"{stopped}: {e} (see its log)") from None
        except PeerLost as e:
            raise PeerStopped(f"{stopped}: another rank died or did not answer within parallel.timeout_s "
                              f"({self.timeout.total_seconds():g} s): {e}") from None

    def close(self) -> None:
        """Drop our references to the process groups and leave the job."""
        self.groups, self._patient = {name: None for name in self.groups}, None
        leave_job()
