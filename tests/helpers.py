"""Launch sixfold commands and torchrun workers from tests (real processes, gloo)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def sixfold(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `sixfold ARGS` in a fresh process; output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "sixfold.cli", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


def torchrun(script: str, nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """nproc ranks of tests/workers/SCRIPT.py, or of a module (`sixfold.cli`), under plain torchrun."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    what = [str(ROOT / "tests" / "workers" / script)] if script.endswith(".py") else ["-m", script]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *what, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, timeout=timeout)
