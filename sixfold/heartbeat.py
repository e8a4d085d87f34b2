"""Some ranks run a long task while the others wait, with no limit on the task's length but a bound on silence:
every rank checks in with the rest every `interval` seconds (a working rank from a thread of its own), in a
gloo group whose collectives time out. A rank that dies, hangs or loses its machine stops answering, and the
others' next check fails within the group's timeout; a task that raises stops everyone at the next check. A
working rank whose check fails stops its task too: its heartbeat raises in the task's thread, which sees it at its
next Python bytecode (a long call into C, such as a tokenizer's batch, finishes first)."""
from __future__ import annotations

import ctypes
import threading

import torch
import torch.distributed as dist


class PeerFailed(RuntimeError):
    """Another rank's task raised (its error is in its own log)."""


class PeerLost(RuntimeError):
    """A check did not complete: a rank died or did not answer within the group's timeout."""


class _Stopped(BaseException):
    """Raised in a working rank's task by its heartbeat, past the task's own `except Exception`."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in the thread at its next bytecode (None: withdraw one not yet raised)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


def in_turn(group: dist.ProcessGroup, fn, mine: bool, interval: float):
    """fn() on the ranks with `mine` (None elsewhere); returns once every rank of `group` has finished. Raises
    fn()'s own error where it raised, PeerFailed on the others, PeerLost where a check failed."""
    finished, state, error = threading.Event(), [0, 0], []  # state: done, failed

    def check_in() -> None:
        while True:
            counts = torch.tensor([int(mine), *state], dtype=torch.int64)
            try:
                dist.all_reduce(counts, group=group)
            except RuntimeError as e:
                raise PeerLost(str(e)) from None
            working, done, failed = counts.tolist()
            if failed:
                raise PeerFailed(f"{failed} rank(s) failed")
            if done == working:
                return
            if mine:
                finished.wait(interval)

    if not mine:
        check_in()
        return None

    worker, lock, running = threading.get_ident(), threading.Lock(), [True]

    def beat() -> None:
        try:
            check_in()
        except RuntimeError as e:
            error.append(e)
            with lock:
                if running[0]:
                    _raise_in(worker, _Stopped)

    thread = threading.Thread(target=beat, daemon=True)
    try:
        try:
            thread.start()  # inside: its first check may already raise here
            out = fn()
            state[0] = 1
        except _Stopped:
            raise
        except BaseException:
            state[1] = 1
            raise
        finally:
            with lock:
                running[0] = False
                _raise_in(worker, None)
            finished.set()
            thread.join()
    except _Stopped:  # the heartbeat's error, raised in fn()
        raise error[0] from None
    if error:
        raise error[0]
    return out
