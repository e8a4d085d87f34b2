"""Errors that ranks raise together: a failed collective, a rank stopped for another's failure, and the mark of an
error that every rank raises alike (said once a machine, not once a rank)."""
from __future__ import annotations

import contextlib


class CommError(RuntimeError):
    """A collective that failed or timed out; the message names its group and what to check."""

    def __init__(self, name: str, ranks: tuple[int, ...], error: Exception, hint: str = "", absent: str = ""):
        said = f"{name} over ranks {list(ranks)} failed: {error}. " + (hint or (
            "A rank of that group crashed or did not reach the same collective within parallel.timeout_s; see its "
            "log"))
        super().__init__(said.rstrip(".") + "." + absent if absent else said)


@contextlib.contextmanager
def collective(name: str, ranks, hint: str = "", roll_call=None):
    """The failure of the collective inside (a rank crashed, or a timeout) as a CommError naming it, and with a
    RollCall (rollcall.py) the ranks of the group to look at."""
    try:
        yield
    except CommError:
        raise
    except RuntimeError as e:  # torch.distributed's DistError too; an allocation that failed stays what it is
        if out_of_memory(e):
            raise
        raise CommError(name, tuple(ranks), e, hint, roll_call.absent(name, ranks) if roll_call else "") from None


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is an allocation that failed (torch.OutOfMemoryError on CUDA, known by name: this module does
    not import torch; a RuntimeError on CPU)."""
    return isinstance(e, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(e).__mro__) or \
        "can't allocate memory" in str(e)


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite losses, memory, a full disk); the message says what to change."""


class OutOfMemory(TrainingError):
    """A rank ran out of memory in a step (torch.OutOfMemoryError on CUDA, a failed allocation on CPU)."""


class PeerStopped(RuntimeError):
    """A rank stopped while the ranks ran a step in turn, because another failed, died or did not answer."""


def on_every_rank(error: Exception) -> Exception:
    """`error`, marked as raised alike by every rank (after an exchange of problems, or from values all ranks
    hold), or by every rank of a machine (from its command line and files): the command line prints it once a
    machine, from its first rank, not once a rank."""
    error.on_every_rank = True
    return error
