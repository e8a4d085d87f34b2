"""Stopping early on SIGTERM, the signal of a scheduler's preemption (Slurm, Kubernetes) and of torchrun shutting
its workers down (each gives some seconds' grace before SIGKILL), on Ctrl-C (SIGINT), or on SIGHUP (the terminal or
ssh session it ran in closed). The trainer notes the signal, finishes the step under way, and once every rank has
heard of it (a rank told alone passes it on) writes a checkpoint and ends. A signal ignored when the process starts
(SIGHUP under nohup, SIGINT in a shell's background job) stays ignored."""
from __future__ import annotations

import signal
import threading

# a scheduler's preemption, Ctrl-C, a terminal closed (no SIGHUP on Windows)
SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)) if s is not None)
SIGNAL_NAMES = tuple(s.name for s in SIGNALS)


def heeded() -> list[signal.Signals]:
    """The SIGNALS this process does not ignore (call from the main thread)."""
    return [sig for sig in SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]


class Stopped(RuntimeError):
    """Training ended early on a signal, after a checkpoint when checkpoints are on; the message says how to go on."""

    def __init__(self, message: str, signal_name: str):
        super().__init__(message)
        self.exit_code = 128 + signal.Signals[signal_name]  # what a shell reports for a process the signal ended


class StopSignal:
    """While entered (in the main thread): SIGTERM, SIGINT or SIGHUP is noted (`received`: the first one's name)
    instead of ending the process at once. A second SIGINT is noted too: a torchrun that a terminal's Ctrl-C
    reached sends its ranks the same signal again."""

    def __init__(self):
        self.received = ""
        self._previous: dict = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._note) for sig in heeded()}
        return self

    def _note(self, signum, frame) -> None:
        self.received = self.received or signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():  # None: a handler not set from Python, which cannot be put
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)  # back; the default then
