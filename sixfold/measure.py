"""What benchmarks measure and record: a process's peak memory, the cores other processes kept busy, the
machine, the sixfold commit, and the tables in docs/benchmarks.md (shared by `sixfold bench` and bench/)."""
from __future__ import annotations

import importlib
import os
import platform
import resource
import subprocess
import time
from pathlib import Path
from typing import Callable, TypeVar

ROOT = Path(__file__).resolve().parent.parent
QUIET = 0.1  # cores other processes may keep busy during a timed run before it counts as disturbed
DOC = ROOT / "docs" / "benchmarks.md"
T = TypeVar("T")


# ---- memory of this process ----

def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def mark_memory() -> int:
    """Reset this process's peak RSS to its current RSS and return that RSS less its file-backed pages (kB). The
    libraries torch loads on first use (torch._dynamo and sympy, some 70 MB: by torch.optim, a checkpointed block's or
    a pipeline stage's first backward) are loaded first, so that a peak counts the training's memory, not library
    code."""
    importlib.import_module("torch._dynamo")

    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS") - _status_kb("RssFile")


def machine_bytes(root: Path = Path("/")) -> int:
    """The memory this process may use (bytes): the machine's physical memory, or less where the process's cgroup
    (a container's) or one above it is limited to less: cgroup v2's memory.max, v1's memory.limit_in_bytes ("max"
    and v1's huge unlimited value are no limit). `root`: where /proc and /sys are found (a test's fake tree)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min([physical, *cgroup_limits(root)])


def cgroup_limits(root: Path = Path("/")) -> list[int]:
    """The memory limits of this process's cgroup and of those above it, as /proc/self/cgroup names them under
    /sys/fs/cgroup: the v2 hierarchy's ("0::PATH", memory.max) and the v1 memory controller's ("N:memory:PATH",
    memory/.../memory.limit_in_bytes). A cgroup not mounted at its path (a container that sees only its own, at the
    mount's root) is read where it is mounted."""
    mounts = root / "sys" / "fs" / "cgroup"
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            top, name = mounts, "memory.max"
        elif "memory" in controllers.split(","):
            top, name = mounts / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts) + 1):  # the mount's root, then each cgroup down to the process's own
            try:
                value = (top.joinpath(*parts[:depth]) / name).read_text().strip()
            except OSError:
                continue
            if value.isdigit():
                limits.append(int(value))
    return limits


def peak_mb(base_kb: int) -> float:
    """Peak RSS since mark_memory() less the file-backed pages resident now, above mark_memory()'s, in MB (2**20
    bytes). File-backed pages are library code run for the first time (some 15 MB of torch's in a DDP step) or a
    memory-mapped corpus: the kernel drops and reads them again at will, and the side whose setup ran more kernels
    before the mark would count less of them. They only grow in a run: those resident now are at least those at the
    peak, so the peak falls short by no more than what was first read after it."""
    return (_status_kb("VmHWM") - _status_kb("RssFile") - base_kb) / 1024


# ---- load of the machine ----

def busy_jiffies() -> int:
    """CPU time (1/100 s) the whole machine has spent busy since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait; guest time is within user and nice


def job_jiffies() -> int:
    """CPU time (1/100 s) of this process's finished children."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return round((r.ru_utime + r.ru_stime) * 100)


def others_while(run: Callable[[], T]) -> tuple[T, float]:
    """run()'s result, and the cores that processes other than run()'s children kept busy meanwhile (a sign
    of a shared, noisy machine)."""
    busy, mine, began = busy_jiffies(), job_jiffies(), time.perf_counter()
    out = run()
    others = ((busy_jiffies() - busy) - (job_jiffies() - mine)) / 100 / (time.perf_counter() - began)
    return out, max(others, 0.0)


# ---- what a table records ----

def machine(accelerator: str = "gloo") -> str:
    import torch
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{os.cpu_count()}-core CPU ({cpu}), {platform.system()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {accelerator}")


def revision() -> str:
    """The sixfold commit measured, and whether sixfold/ had uncommitted changes."""
    def git(*a):
        return subprocess.run(["git", "-C", str(ROOT), *a], text=True, capture_output=True).stdout.strip()
    dirty = " with uncommitted changes in sixfold/" if git("status", "--porcelain", "sixfold") else ""
    return f"commit {git('rev-parse', '--short', 'HEAD') or 'unknown'}{dirty}"


def write_doc(name: str, title: str, body: str, doc: Path = DOC, first: bool = False) -> None:
    """Put body between the markers of `name` in `doc`, adding a section titled `title` if they are missing: at
    the end, or with `first` right under the page's title."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    elif first:
        heading, _, rest = text.partition("\n")
        text = f"{heading}\n\n## {title}\n\n{block}\n\n{rest.lstrip()}"
    else:
        text = text.rstrip("\n") + f"\n\n## {title}\n\n" + block + "\n"
    doc.parent.mkdir(exist_ok=True)
    doc.write_text(text)
