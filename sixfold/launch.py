"""Start this machine's ranks with torchrun, or tell that we already run under it; end a process at once."""
from __future__ import annotations

import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import NoReturn

from .stop import Interrupted, Stopped, put_back, take


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _env(threads: str | None) -> dict[str, str]:
    """This environment, with OMP_NUM_THREADS `threads` (default: as set here, else 1)."""
    return {**os.environ, "OMP_NUM_THREADS": threads or os.environ.get("OMP_NUM_THREADS", "1")}


def run_torchrun(nproc: int, argv: list[str], capture: bool = False, module: str = "sixfold.cli",
                 threads: str | None = None, stops: bool = False) -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGV` (by default `sixfold ARGV`) as `nproc` ranks on this machine (a standalone
    rendezvous on a free port). `stops`, or a captured output: a signal stops this process too (_run)."""
    cmd = [sys.executable, "-m", "sixfold.launch", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, *argv]
    return _run(cmd, _env(threads), capture, capture or stops, hold=True)


def _end_with_parent(hold: bool = False):
    """What the child runs before it starts (None off Linux): Linux is to send it SIGTERM when this launcher dies
    (kill -9 too), which torchrun passes on to the ranks, instead of leaving the job running unseen. prctl is
    looked up here, in the parent: the forked child only calls it (and ends if the launcher is gone already).
    With `hold` (torchrun), SIGINT is blocked, kept for torchrun() to take: Python's own start ended on it with a
    traceback of its own and exit code 1."""
    if sys.platform != "linux":
        return None
    import ctypes
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def child() -> None:
        if hold:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(128 + signal.SIGTERM)

    return child


def _run(cmd: list[str], env: dict[str, str], capture: bool, stops: bool,
         hold: bool = False) -> subprocess.CompletedProcess:
    """Run a job in its own session and pass SIGTERM, SIGINT (Ctrl-C) or SIGHUP on to it, each one: torchrun (this
    module's, _Signals) stops its ranks on the first, whenever it comes, and waits for them through the later ones;
    training ranks finish the step, write a checkpoint and end (stop.py). Without this a scheduler's SIGTERM to
    this launcher alone would leave the job running; if the launcher is killed outright, the job gets
    SIGTERM all the same (_end_with_parent). A job run for its results (`stops`: a bench, check or matrix job)
    ends this process too once it has stopped: Stopped, its temporary files removed on the way out. `hold`: the
    job is sixfold's torchrun (_end_with_parent)."""
    pipe = subprocess.PIPE if capture else None
    job = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_end_with_parent(hold), text=True,
                           stdout=pipe, stderr=pipe)
    heard = []

    def forward(signum, frame) -> None:
        heard.append(signal.Signals(signum).name)
        job.send_signal(signum)
        if len(heard) == 2:
            print(f"sixfold: stopping on {heard[0]} already: the ranks finish the step under way and write their "
                  "checkpoint, and torchrun kills any that is still running after its grace time (30 s by default)",
                  file=sys.stderr, flush=True)

    previous = take(forward)
    try:
        out, err = job.communicate()
    finally:
        put_back(previous)
    if heard and stops:
        raise Stopped(f"stopped by {heard[0]}, and the job it ran with it", heard[0])
    # a job a signal ended (torchrun before it handles them, as it starts) as a shell reports it: 128 + the signal
    code = 128 - job.returncode if job.returncode < 0 else job.returncode
    return subprocess.CompletedProcess(cmd, code, out, err)


def run_ranks(nproc: int, module: str, argv: list[str], threads: str | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGV` as `nproc` ranks, output captured: one process started directly (no torchrun to
    wait for), more under torchrun."""
    if nproc > 1:
        return run_torchrun(nproc, argv, capture=True, module=module, threads=threads)
    return _run([sys.executable, "-m", module, *argv], _env(threads), capture=True, stops=True)


HOLD = "SIXFOLD_TEST_HOLD_RANKS"  # tests: a file torchrun writes once its ranks are started, then it awaits a signal
UNSAID = ("Received %s death signal, shutting down workers", "Got termination signal: %s")  # torchrun's: said below


class _Signals:
    """torchrun's SIGTERM, SIGINT, SIGHUP (and SIGQUIT), none lost. torchrun's own handler, taken over as it starts
    its ranks, raises at once: a signal that came while they were being started ended torchrun with the ranks
    started so far unseen (none stopped, they trained on), and Ctrl-C's KeyboardInterrupt before could be caught on
    the way. Here the first signal ends torchrun before any rank starts (Interrupted), or, when it comes as they
    start, once all have started: torchrun stops them with it. Later ones act the same until torchrun stops its
    ranks, and are noted only after (raised, they ended its wait for the ranks and left them running unseen;
    passed on, they cut a rank's way out short, past its checkpoint)."""

    def __init__(self):
        self.heard: list[signal.Signals] = []
        self.agent = None  # torchrun's, once it starts ranks
        self.starting = False
        self.closing = False  # torchrun is stopping its ranks (or they have ended)

    def take_torchruns(self) -> None:
        """The signals torchrun takes as it starts its ranks (its handler this one)."""
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        from torch.distributed.elastic.multiprocessing import api
        api._terminate_process_handler = self.note
        start, close = LocalElasticAgent._start_workers, LocalElasticAgent._shutdown

        def start_workers(agent, group):
            if self.heard:  # one came before, and was caught on the way
                raise Interrupted(self.heard[0].name)
            self.agent, self.starting = agent, True
            try:
                pids = start(agent, group)
                if os.environ.get(HOLD):
                    self._hold(os.environ[HOLD])
            finally:
                self.starting = False
            if self.heard:  # ended by SIGTERM, which they do not take yet: at once and unsaid (not Python's traceback)
                self._stop(signal.SIGTERM)
            return pids

        def shutdown(agent, *args, **kwargs):
            self.closing = True
            return close(agent, *args, **kwargs)

        LocalElasticAgent._start_workers, LocalElasticAgent._shutdown = start_workers, shutdown

    def note(self, signum, frame) -> None:
        self.heard.append(signal.Signals(signum))
        if self.starting:
            return
        if len(self.heard) == 1 or not self.closing:  # the first, or a later one if the first was caught on the way
            self._stop()

    def _stop(self, send: signal.Signals | None = None) -> NoReturn:
        """End torchrun on the first signal heard, which it sends its ranks (or `send`)."""
        first = self.heard[0]
        if self.agent is None or self.agent._pcontext is None:
            raise Interrupted(first.name)
        from torch.distributed.elastic.multiprocessing.api import SignalException
        raise SignalException(f"Process {os.getpid()} got signal: {first}", sigval=send or first)

    def unsaid(self, sent: signal.Signals) -> bool:
        """Whether the signal `sent` ended local rank 0, which speaks for this machine's ranks when a signal stops
        them outside the training steps, as it started (before it took signals: it has said nothing). Ranks that
        took it by then end with nothing to say (cli.main)."""
        pcontext = self.agent and self.agent._pcontext
        first = pcontext.subprocess_handlers.get(0) if pcontext else None
        return first is not None and first.proc.returncode == -sent

    def _hold(self, path: str) -> None:
        """Stay where a signal was lost (the ranks started, torchrun not yet told of them) until one comes."""
        with open(path, "w"):
            pass
        while not self.heard:
            time.sleep(0.01)


def torchrun(argv: list[str]) -> int:
    """torchrun ARGV, ending with the ranks' own exit code (the first failed rank's; 128 + the signal when torchrun
    itself is stopped by one) instead of torchrun's traceback and 1: each rank has said what went wrong. Its
    directory of the ranks' error files is removed at the end (torchrun leaves one in the temporary directory at
    every run) unless ARGV names one (--log-dir, before the module run)."""
    signals = _Signals()
    take(signals.note)  # until torch is loaded: Interrupted
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])  # one that came as Python started is heard now
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main
    signals.take_torchruns()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)  # said below
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(lambda r: r.msg not in UNSAID)
    own = argv[:argv.index("-m")] if "-m" in argv else argv
    named = any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in own)
    logs = None if named else tempfile.mkdtemp(prefix="sixfold_torchrun_")
    try:
        main(argv if named else [f"--log-dir={logs}", *argv])
    except ChildFailedError as e:
        rank, first = e.get_first_failure()  # the earliest: the cause, the others were stopped for it
        if first.exitcode > 0:  # the rank has said why
            return first.exitcode
        print(_killed(rank, first.pid, first.signal_name()), file=sys.stderr)
        return 128 - first.exitcode
    except SignalException as e:  # the ranks it stopped have said so, unless it ended them before they could
        first = signals.heard[0] if signals.heard else e.sigval
        if signals.unsaid(e.sigval):
            print(f"sixfold: stopped by {first.name} as the ranks started", file=sys.stderr, flush=True)
        return 128 + int(first)
    finally:
        if logs is not None:
            shutil.rmtree(logs, ignore_errors=True)
    return 0


def _killed(rank: int, pid: int, signal_name: str) -> str:
    """What to say of a rank that a signal ended before it could say anything itself."""
    why = " (the kernel's out-of-memory killer sends it; `dmesg` says if it did)" if signal_name == "SIGKILL" else ""
    return (f"sixfold error: rank {rank} (pid {pid}) was ended by {signal_name}{why}, and torchrun stopped the other "
            f"ranks. A training run goes on from its last checkpoint when the same command is run with "
            f"checkpoint.resume=auto")


def end(code: int) -> NoReturn:
    """Exit with `code`, what the process holds frozen first: the interpreter's exit then skips collecting it, which
    takes 0.6 s once torch is loaded (paid by the command, its torchrun and each rank at every run's end)."""
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    try:
        code = torchrun(sys.argv[1:])
    except KeyboardInterrupt as e:  # Interrupted too: before any rank started
        name = getattr(e, "signal_name", "SIGINT")
        print(f"sixfold: stopped by {name} before any rank started", file=sys.stderr, flush=True)
        code = 128 + signal.Signals[name]
    end(code)
