"""Stopping early on SIGTERM, the signal of a scheduler's preemption (Slurm, Kubernetes) and of torchrun shutting
its workers down: each gives some seconds' grace before SIGKILL. The trainer notes the signal, finishes the step
under way, and once every rank has heard of it (a rank told alone passes it on) writes a checkpoint and ends."""
from __future__ import annotations

import signal
import threading

SIGNAL = signal.SIGTERM


class Stopped(RuntimeError):
    """Training ended early on SIGTERM, after a checkpoint when checkpoints are on; the message says how to go on."""

    exit_code = 128 + SIGNAL  # what a shell reports for a process that SIGTERM ended


class StopSignal:
    """While entered (in the main thread): SIGTERM is noted instead of ending the process at once."""

    def __init__(self):
        self.received = False
        self._installed = False
        self._previous = None

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous, self._installed = signal.signal(SIGNAL, self._note), True
        return self

    def _note(self, signum, frame) -> None:
        self.received = True

    def __exit__(self, *exc) -> None:
        if self._installed:  # None: a handler not set from Python, which cannot be put back; the default then
            signal.signal(SIGNAL, signal.SIG_DFL if self._previous is None else self._previous)
