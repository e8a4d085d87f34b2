"""Start this machine's ranks with torchrun, or tell that we already run under it."""
from __future__ import annotations

import os
import subprocess
import sys


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def run_torchrun(nproc: int, argv: list[str], capture: bool = False,
                 module: str = "sixfold.cli") -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGV` (by default `sixfold ARGV`) as `nproc` ranks on this machine (a standalone
    rendezvous on a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, *argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(cmd, env=env, text=True, capture_output=capture)
