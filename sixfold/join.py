"""Joining and leaving a torchrun job: the backend and device, the job's store, this start's keys in it, the world
group; and the mark by which a machine's first rank tells the others it is done."""
from __future__ import annotations

import gc
import os
import re
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
# before any group exists: the default group of its functions would pin the world group
import torch.distributed.nn  # noqa: F401

from .config import ConfigError
from .errors import collective
from .rollcall import RollCall

POST_EVERY_S = 1.0  # how often rank 0 posts a start's number again to the ranks that have not taken it
JOB_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets for each rank (env://)


def pick_device() -> tuple[str, torch.device]:
    """Backend and device, chosen once: NCCL + CUDA where GPUs exist, gloo + CPU otherwise."""
    if torch.cuda.is_available():
        local, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local >= count:
            raise ConfigError(f"local rank {local} has no GPU of its own: this machine shows {count} (CUDA_VISIBLE_"
                              f"DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most {count} "
                              f"ranks on it (torchrun --nproc-per-node), over more machines, or set parallel.* to a "
                              f"world size that fits")
        torch.cuda.set_device(local)
        return "nccl", torch.device("cuda", local)
    return "gloo", torch.device("cpu")


def _whole(name: str, low: int, high: int | None = None) -> int:
    """Environment variable `name`, a whole number from `low` (to `high`): refused, named, if it is not one."""
    text = os.environ[name].strip()
    if not re.fullmatch(r"[0-9]+", text) or int(text) < low or (high is not None and int(text) > high):
        limit = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise _env_error(f"{name}={os.environ[name]!r} is not a whole number {limit}")
    return int(text)


def _env_error(problem: str) -> ConfigError:
    return ConfigError(f"{problem}: each rank of a job needs {', '.join(JOB_ENV[:-1])} and {JOB_ENV[-1]} as torchrun "
                       f"sets them; start the ranks with torchrun (or on one machine with sixfold train --nproc N), "
                       f"or set them so")


def job_world() -> int:
    """The job's WORLD_SIZE (1 where it is not set: one process alone)."""
    return _whole("WORLD_SIZE", 1) if "WORLD_SIZE" in os.environ else 1


def job_env() -> tuple[int, int, str, int]:
    """This rank's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; one missing or not a number (a rank started by
    hand, or by another launcher) is refused, named."""
    missing = [name for name in JOB_ENV if not os.environ.get(name, "").strip()]
    if missing:
        one = len(missing) == 1
        raise _env_error(f"{', '.join(missing[:-1])}{'' if one else ' and '}{missing[-1]} {'is' if one else 'are'} "
                         f"not set")
    world = _whole("WORLD_SIZE", 1)
    return _whole("RANK", 0, world - 1), world, os.environ["MASTER_ADDR"].strip(), _whole("MASTER_PORT", 1, 65535)


def _agent_store() -> bool:
    """Whether torchrun's agent hosts the job's store (then it outlives the ranks, through restarts)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _store(timeout: timedelta, rank: int = -1, world: int | None = None) -> dist.TCPStore:
    """The job's rendezvous store: the agent's, or rank 0's."""
    address, port = job_env()[2:]
    return dist.TCPStore(address, port, world, is_master=rank == 0 and not _agent_store(), timeout=timeout)


def _attempt_store(store: dist.TCPStore, rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The store's keys for this start of the job: a restarted job must not read the addresses that the ranks it
    replaces left in the agent's store. Each start is numbered by its rank 0 and the number posted to each other
    rank, again every POST_EVERY_S until every rank has said it took it. A rank clears its post before it waits for
    one: a post left by a rank of an earlier start that ended before reading it is gone then. (torchrun's c10d
    rendezvous restarts every machine's ranks before any starts again, so no rank of the earlier start is still
    joining. Under a static one each agent restarts only its own ranks, once they fail: after the world group
    exists, the others fail in their next collective with the lost rank, and the ranks that start first wait for the
    new rank 0's number; a rank lost while the others are still joining is restarted alone and may join the start
    they are in. TORCHELASTIC_RESTART_COUNT cannot number the starts: under c10d each machine's agent counts only
    the restarts it began.)"""
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


def join_job(timeout: timedelta) -> tuple[int, RollCall]:
    """Join the torchrun job (its world group); returns this process's rank and its roll call in the job's store."""
    rank, world = job_env()[:2]
    backend, device = pick_device()
    hint = (f"Check MASTER_ADDR and MASTER_PORT (torchrun's --rdzv-endpoint), and that every rank started within "
            f"parallel.timeout_s ({timeout.total_seconds():g} s; raise it where they start further apart, as on a busy "
            f"machine); see their logs")
    with collective(f"joining the job as rank {rank}", range(world), hint):
        store = _attempt_store(_store(timeout, rank, world), rank, world, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
        roll_call = RollCall(store, rank, timeout.total_seconds())
    return rank, roll_call


def leave_job() -> None:
    """Destroy every process group, and collect what still refers to one, so that each group's worker threads are
    joined now. A gloo worker that releases a finished collective's tensors after the interpreter has begun to exit
    needs the GIL and aborts the process ("terminate called without an active exception"); call this last, with
    no process group left referenced. A rank's objects are then frozen: its exit skips collecting them (see
    launch.end)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()
        gc.freeze()
    else:
        gc.collect()
