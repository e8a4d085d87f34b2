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
from typing import NoReturn

from .stop import Stopped, put_back, take


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
    return _run(cmd, _env(threads), capture, capture or stops)


def _end_with_parent():
    """What the child runs before it starts (None off Linux): Linux is to send it SIGTERM when this launcher dies
    (kill -9 too), which torchrun passes on to the ranks, instead of leaving the job running unseen. prctl is
    looked up here, in the parent: the forked child only calls it (and ends if the launcher is gone already)."""
    if sys.platform != "linux":
        return None
    import ctypes
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def child() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(128 + signal.SIGTERM)

    return child


def _run(cmd: list[str], env: dict[str, str], capture: bool, stops: bool) -> subprocess.CompletedProcess:
    """Run a job in its own session and pass SIGTERM, SIGINT (Ctrl-C) or SIGHUP on to it, the first one only (torchrun,
    given another while it stops its ranks, gives up waiting for them and leaves them running unseen); torchrun sends
    it to its ranks: training ones finish the step, write a checkpoint and end (stop.py). Without this a scheduler's
    SIGTERM to this launcher alone would leave the job running; if the launcher is killed outright, the job gets
    SIGTERM all the same (_end_with_parent). A job run for its results (`stops`: a bench, check or matrix job)
    ends this process too once it has stopped: Stopped, its temporary files removed on the way out."""
    pipe = subprocess.PIPE if capture else None
    job = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_end_with_parent(), text=True,
                           stdout=pipe, stderr=pipe)
    heard = []

    def forward(signum, frame) -> None:
        heard.append(signal.Signals(signum).name)
        if len(heard) == 1:
            job.send_signal(signum)
        elif len(heard) == 2:
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


def torchrun(argv: list[str]) -> int:
    """torchrun ARGV, ending with the ranks' own exit code (the first failed rank's; 128 + the signal when torchrun
    itself is stopped by one) instead of torchrun's traceback and 1: each rank has said what went wrong. Its
    directory of the ranks' error files is removed at the end (torchrun leaves one in the temporary directory at
    every run) unless ARGV names one (--log-dir)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)  # said below
    named = any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in argv)
    logs = None if named else tempfile.mkdtemp(prefix="sixfold_torchrun_")
    try:
        main(argv if named else [f"--log-dir={logs}", *argv])
    except ChildFailedError as e:
        rank, first = e.get_first_failure()  # the earliest: the cause, the others were stopped for it
        if first.exitcode > 0:  # the rank has said why
            return first.exitcode
        print(_killed(rank, first.pid, first.signal_name()), file=sys.stderr)
        return 128 - first.exitcode
    except SignalException as e:
        return 128 + int(e.sigval)
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
    except KeyboardInterrupt:  # a Ctrl-C passed on before torchrun took SIGINT over: no traceback
        code = 128 + signal.SIGINT
    end(code)
