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


def take(handler, signals: tuple = SIGNALS) -> dict:
    """`handler` for each of `signals` this process does not ignore, from the main thread (elsewhere none): the
    handlers before, for put_back."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN}


def put_back(previous: dict) -> None:
    """The handlers take() replaced; None (a handler not set from Python, which cannot be put back): the default."""
    for sig, handler in previous.items():
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside the training steps, raised as Ctrl-C's KeyboardInterrupt is (and handled where it is):
    the process unwinds (its temporary files removed) and ends with one line, where the signal's default ended it at
    once and unsaid."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def interrupting() -> dict:
    """SIGTERM and SIGHUP raise Interrupted (StopSignal takes them over during training): the handlers before, for
    put_back."""
    def interrupt(signum, frame) -> None:
        raise Interrupted(signal.Signals(signum).name)

    return take(interrupt, tuple(s for s in SIGNALS if s != signal.SIGINT))


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
        self.heard = ""  # a signal any rank received, as the ranks found it together (Trainer.sample)
        self._previous: dict = {}

    def __enter__(self) -> "StopSignal":
        self._previous = take(self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.received = self.received or signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        put_back(self._previous)
