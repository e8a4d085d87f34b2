"""The terminal going away under a run: a pipe whose reader has ended (`sixfold train ... | head`), a terminal
that hung up. What the run writes there is dropped and the run goes on."""
from __future__ import annotations

import contextlib
import os
import select
import sys
from typing import Callable


def console(write: Callable, *args) -> None:
    """write(*args) to the terminal; where it has gone, the run goes on without it (lose_console)."""
    try:
        write(*args)
    except OSError:
        lose_console()


def lose_console() -> None:
    """stdout or stderr, whichever has gone, is pointed at /dev/null for the rest of the process; the other one
    says so, if it can. A write that failed otherwise (a full disk) is dropped, and the next one tried."""
    for stream, other in ((sys.stdout, sys.stderr), (sys.stderr, sys.stdout)):
        if gone(stream):
            mute(stream)
            with contextlib.suppress(OSError, ValueError):
                print(f"sixfold: {'stdout' if stream is sys.stdout else 'stderr'} has gone (its reader ended or its "
                      f"terminal hung up); the run goes on without it, its steps in metrics.jsonl", file=other,
                      flush=True)


def gone(stream) -> bool:
    """Whether the stream's file descriptor reports an error or a hang-up (a pipe whose reader has ended does)."""
    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no descriptor (a captured stream), no poll.poll (Windows)
        return False


def mute(stream) -> None:
    """Point the stream's file descriptor at /dev/null, if it has one."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)
