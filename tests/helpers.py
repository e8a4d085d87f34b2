"""Launch sixfold commands and torchrun workers from tests (real processes, gloo)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
LONG = ["train.steps=30", "parallel.dp_replicate=2"]  # the runs stopped mid-way, on 2 ranks


def sixfold(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `sixfold ARGS` in a fresh process; output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "sixfold.cli", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


def torchrun(script: str, nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """nproc ranks of tests/workers/SCRIPT.py, or of a module (`sixfold.cli`), under plain torchrun."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    what = [str(ROOT / "tests" / "workers" / script)] if script.endswith(".py") else ["-m", script]
    with tempfile.TemporaryDirectory(prefix="sixfold_test_torchrun_") as logs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--log-dir={logs}", *what, *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, timeout=timeout)


def multirun(where: Path, nproc: int, runs: dict[str, list[str]], timeout: int = 480) -> subprocess.CompletedProcess:
    """Runs of TINY, each with its overrides and log.run_dir=WHERE/NAME, in order in one torchrun job of `nproc`
    ranks (sixfold.multirun: its processes start once, and a run may resume from an earlier one's checkpoint);
    every run is asserted to have trained."""
    from sixfold.config import load_config
    from sixfold.multirun import read_results, write_plan
    plan = where / "plan.json"
    write_plan(plan, [(name, load_config(TINY, [f"log.run_dir={where / name}", *overrides]))
                      for name, overrides in runs.items()], 60)
    proc = torchrun("sixfold.multirun", nproc, str(plan), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = read_results(plan)
    failed = [r["error"] for r in results.values() if not r["ok"]]
    assert len(results) == len(runs) and not failed, failed or proc.stderr[-3000:]
    return proc


def torchrun_logs() -> str:
    """A --log-dir for a torchrun agent, which otherwise leaves one in the temporary directory at every run; removed
    with the test's agents (end_machines)."""
    return f"--log-dir={tempfile.mkdtemp(prefix='sixfold_test_torchrun_')}"


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_machines(count: int, nproc: int, *args: str, restarts: int = 0, rdzv: str = "c10d",
                   own: dict[int, list[str]] | None = None, cwds: list[Path] | None = None) -> list[subprocess.Popen]:
    """`sixfold ARGS` as `count` machines of `nproc` ranks each, as on a cluster: one torchrun agent per machine,
    all meeting at one rendezvous endpoint (on this host, a free port): c10d's, or with `rdzv="static"` the first
    machine's (torchrun's default, given --node-rank and --master-addr). `own`: more arguments of some machines;
    `cwds`: each machine's working directory (its relative paths: as if on a disk of its own), else the checkout."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = []
    for n in range(count):
        meet = [f"--node-rank={n}", "--master-addr=127.0.0.1", f"--master-port={port}"] if rdzv == "static" else \
            ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job-{port}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={count}", f"--nproc-per-node={nproc}", *meet,
               f"--max-restarts={restarts}", torchrun_logs(), "-m", "sixfold.cli", *args, *(own or {}).get(n, [])]
        agents.append(subprocess.Popen(cmd, cwd=cwds[n] if cwds else ROOT, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return agents


def machines(count: int, nproc: int, *args: str, timeout: int = 300, rdzv: str = "c10d",
             own: dict[int, list[str]] | None = None,
             cwds: list[Path] | None = None) -> list[subprocess.CompletedProcess]:
    """start_machines(), waited for: each agent's exit code and output."""
    agents = start_machines(count, nproc, *args, rdzv=rdzv, own=own, cwds=cwds)
    try:
        outputs = [a.communicate(timeout=timeout) for a in agents]
    finally:
        end_machines(agents)
    return [subprocess.CompletedProcess(a.args, a.returncode, *out) for a, out in zip(agents, outputs)]


def end_machines(agents: list[subprocess.Popen]) -> None:
    """Kill what is left of start_machines()' agents, their ranks first (each leads a process group of its own), and
    remove their torchrun_logs()."""
    for agent in agents:
        for rank in children(agent.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rank, signal.SIGKILL)
        agent.kill()
        agent.wait()
        for arg in agent.args:
            if arg.startswith("--log-dir="):
                shutil.rmtree(arg.split("=", 1)[1], ignore_errors=True)
