"""sixfold bench: a layout's step time and memory, the longest sequence that fits, and its refusals."""
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sixfold import maxseq
from sixfold.cli import main
from sixfold.config import load_config
from sixfold.data import load_data
from sixfold.maxseq import at_length, longest
from helpers import ROOT, TINY


@pytest.mark.parametrize("layout", [[], ["parallel.dp_replicate=2"]])
def test_workload_times_a_layout(capsys, layout):
    assert main(["bench", TINY, *layout, "--steps", "3"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"(\d+\.\d+) s/step \(rank 0, mean of steps 3-3\), peak MB per rank ([\d, ]+);", out)
    assert found, out
    peaks = [float(v) for v in found[2].split(", ")]
    assert float(found[1]) > 0 and len(peaks) == 1 + len(layout) and min(peaks) > 0


def test_a_timed_run_gives_its_steps_alone_and_from_step_to_step():
    """step_s times the steps themselves; wall_s the loop from one step's end to the next (what a peer's log stamps
    give: bench/vs_torchtitan.py), which holds the step and the loop's own work between steps."""
    from sixfold.bench import time_run, workload_config

    r = time_run(workload_config(TINY, [], 4), "1")
    assert 0 < r["step_s"] <= r["wall_s"] < r["step_s"] + 1, r


def test_per_step_times_the_steps_after_warm_up_from_their_ends():
    """From the times steps 1-5 ended: steps 3-5 took 9 - 3 seconds (sixfold's wall_s, DeepSpeed's side of
    bench/vs_deepspeed.py)."""
    from sixfold.bench import WARMUP, per_step

    assert WARMUP == 2 and per_step([1.0, 3.0, 4.0, 6.0, 9.0]) == 2.0


def test_the_table_gives_each_layouts_median_time_and_median_peak():
    """3 jobs of each layout: the largest rank's peaks 300, 120 and 500 MB give 300 (the median, as the time's and
    every other table's), not 500."""
    from sixfold.bench import TABLE, report

    jobs = [{"step_s": s, "peak_mb": p, "others": 0.01, "accelerator": "gloo"}
            for s, p in ((0.30, [100, 300]), (0.20, [120, 110]), (0.40, [500, 90]))]
    body = report([jobs] * len(TABLE), ["bench", "--table", "--runs", "3"], "commit abc", 10)
    assert "| dp 2 | **0.300** (0.200-0.400) | 0.678 | 0.984 (DDP), 1.081 (FSDP) | 0.845 | 0.44 | 300 | 0.01 |" in body
    assert "Peak MB: the largest rank's peak memory, median over jobs" in body


def test_peak_memory_counts_what_the_process_holds_not_the_files_it_maps(tmp_path):
    """A 64 MiB file read through a memory map after the mark is file-backed pages (as library code run for the first
    time): not counted; 64 MiB of bytes made after it are."""
    import mmap

    from sixfold.measure import mark_memory, peak_mb
    path = tmp_path / "corpus.bin"
    path.write_bytes(b"\1" * (64 << 20))
    base = mark_memory()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert sum(mapped[i] for i in range(0, len(mapped), 4096)) == 16384  # every page read
        assert peak_mb(base) < 8
    held = b"\1" * (64 << 20)
    assert 60 < peak_mb(base) < 72 and len(held) == 64 << 20


def test_search_brackets_then_bisects_over_valid_lengths():
    cfg = load_config(TINY, ["parallel.cp=2", "parallel.tp=2"])  # lengths: multiples of 4
    probed = []

    def fits(seq):
        probed.append(seq)
        return seq <= 1000

    assert longest(fits, 16, 1 << 20, cfg) == (992, 1024)
    assert probed == [16, 32, 64, 128, 256, 512, 1024, 768, 896, 960, 992]  # down to 1/16 of [512, 1024]
    assert all(at_length(cfg, s) for s in probed) and at_length(cfg, 30) is None
    assert longest(fits, 16, 700, cfg) == (700, None)
    assert longest(fits, 1004, 2000, cfg) == (None, 1004)


cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's memory budget")


@cpu_only
def test_max_seq_on_cpu_stops_below_a_probe_that_does_not_fit(capsys, monkeypatch):
    """32 sequences: about 0.15 GB at 256 tokens, 0.30 GB at 512."""
    monkeypatch.setattr(maxseq, "SPLITS", 2)  # one bisection, not 4: 3 probes
    assert main(["bench", "--max-seq", TINY, "train.global_batch=32", "--budget-gb", "0.2", "--min", "256",
                 "--max", "512"]) == 0
    out = capsys.readouterr().out
    probes = {int(s): verdict == "fits" for s, verdict in re.findall(r"seq +(\d+): (fits|does not fit)", out)}
    answer = re.search(r"measured in \d+ probes: (\d+) \((\d+) does not\)", out)
    assert answer, out
    good, bad = int(answer[1]), int(answer[2])
    assert probes[good] and not probes[bad] and good < bad <= good + 256 // 2, out
    assert "planned peak fits --budget-gb 0.2" in out


@cpu_only
def test_max_seq_looks_no_further_than_the_corpus_holds(capsys, monkeypatch):
    """A probe longer than the train split would fail to read a sequence: the search stops there and says so.
    Every probe fits here (the job is replaced: what it measures is the test above's)."""
    probed = []

    def launch(cfg):
        probed.append(cfg.train.seq_len)
        return SimpleNamespace(oom=False, ranks=[{"device_bytes": 0, "peak_bytes": 1, "oom": False}])

    monkeypatch.setattr(maxseq, "launch", launch)
    overrides = ["data.max_bytes=3000"]
    holds = len(load_data(load_config(TINY, overrides).data).train) - 1
    assert main(["bench", "--max-seq", TINY, *overrides, "--budget-gb", "1", "--min", "1024"]) == 0
    out = capsys.readouterr().out
    assert probed == [1024, 2048, holds], out
    assert f"measured in 3 probes: {holds}, the longest sequence the corpus's train split holds" in out


@cpu_only
def test_a_probe_that_runs_out_of_memory_does_not_fit():
    """A real allocation that fails in a step (the address space capped at 3.5 GB; 64 sequences of 256 tokens ask
    for 2.1 GB of logits at once over 32,768 words), which the trainer turns into its OutOfMemory (as it does
    torch's on CUDA): the probe does not fit, and the search answers, instead of failing with the job."""
    proc = _capped(3_500_000_000, "--max-seq", TINY, "train.global_batch=64", "model.vocab_size=32768", "--budget-gb",
                   "1", "--min", "256", "--max", "256")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "seq     256: does not fit (out of memory);" in proc.stdout
    assert "measured in 1 probes: none: the shortest, 256, does not fit" in proc.stdout


@cpu_only
def test_a_probe_out_of_memory_outside_a_step_does_not_fit():
    """A real allocation that fails before the first step (the address space capped at 2.5 GB; 128M parameters,
    most of them a 1M-word embedding and output, 0.5 GB, with their gradients and AdamW's moments: torch's
    DefaultCPUAllocator's RuntimeError, not the trainer's OutOfMemory): the probe does not fit, and says where."""
    proc = _capped(2_500_000_000, "--max-seq", TINY, "model.vocab_size=1000000", "--budget-gb", "1", "--min", "32",
                   "--max", "32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "seq      32: does not fit (out of memory outside a step);" in proc.stdout
    assert "measured in 1 probes: none: the shortest, 32, does not fit" in proc.stdout


def _capped(address_space: int, *args: str) -> subprocess.CompletedProcess:
    """`sixfold bench ARGS` with its address space (and its ranks') capped."""
    import resource

    def capped():
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    return subprocess.run([sys.executable, "-m", "sixfold.cli", "bench", *args], cwd=ROOT, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, preexec_fn=capped)


@cpu_only
def test_max_seq_on_cpu_needs_a_budget(capsys):
    assert main(["bench", "--max-seq", TINY]) == 2
    assert "sixfold bench --max-seq on CPU needs --budget-gb" in capsys.readouterr().err


@cpu_only
def test_max_seq_refuses_a_cpu_budget_the_machine_does_not_hold(capsys, monkeypatch):
    """2 ranks of 5,000 GB each: no probe could grow that far before the machine ran out."""
    from sixfold.measure import machine_bytes
    monkeypatch.setattr(maxseq, "launch", lambda *a: pytest.fail("a job started"))
    assert main(["bench", "--max-seq", TINY, "parallel.dp_replicate=2", "--budget-gb", "5000"]) == 2
    most = math.floor(machine_bytes() / 2 / 1e8) / 10
    assert (f"--budget-gb 5000 for each of 2 rank(s) is more than the {machine_bytes() / 1e9:.1f} GB of memory here "
            f"(the machine's, or its cgroup's limit if less): a probe would run out of it before a rank reached the "
            f"budget; give --budget-gb {most:g} at most") in capsys.readouterr().err


def _cgroups(root: Path, own: str, limits: dict[str, str]) -> Path:
    """A fake tree at root: /proc/self/cgroup holding `own`, and each file of `limits` (path under /sys/fs/cgroup:
    its text)."""
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "cgroup").write_text(own)
    for path, text in limits.items():
        (root / "sys" / "fs" / "cgroup" / path).parent.mkdir(parents=True, exist_ok=True)
        (root / "sys" / "fs" / "cgroup" / path).write_text(text + "\n")
    return root


@pytest.mark.parametrize("own, limits, expected", [
    ("0::/job/rank\n", {"job/memory.max": "3000000000", "job/rank/memory.max": "max"}, 3_000_000_000),  # the parent's
    ("0::/job\n", {"memory.max": "max", "job/memory.max": "2000000000"}, 2_000_000_000),
    ("0::/job\n", {"job/memory.max": "max"}, None),
    ("5:cpu:/x\n4:memory:/docker/abc\n0::/\n", {"memory/docker/abc/memory.limit_in_bytes": "1500000000"},
     1_500_000_000),
    # a container that sees its own cgroup at the mount's root: /proc/self/cgroup names the host's path
    ("4:memory:/docker/abc\n", {"memory/memory.limit_in_bytes": "1000000000"}, 1_000_000_000),
    ("4:memory:/docker/abc\n", {"memory/memory.limit_in_bytes": "9223372036854771712"}, None),  # v1's unlimited
    ("4:cpu,cpuacct:/docker/abc\n", {"cpu/memory.limit_in_bytes": "1000000000"}, None),  # not the memory controller
    ("0::/\n", {}, None),
])
def test_memory_here_is_the_cgroups_limit_where_it_is_less(tmp_path, own, limits, expected):
    """The CPU budget of --max-seq is checked against this: a container's limit, not the host's memory it shows."""
    from sixfold.measure import machine_bytes
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert machine_bytes(_cgroups(tmp_path, own, limits)) == min(expected or physical, physical)
    assert machine_bytes(tmp_path / "none") == physical  # no /proc/self/cgroup


@pytest.mark.parametrize("argv, message", [
    (["bench", TINY, "parallel.tp=3"], "model.n_heads=4 is not divisible by parallel.tp=3"),
    (["bench", "--max-seq", TINY, "parallel.cp=3", "--budget-gb", "1"], "train.seq_len=32 must be divisible by 6"),
    (["bench", "--max-seq", TINY, "parallel.cp=2", "--budget-gb", "1", "--min", "3", "--max", "3"],
     "no train.seq_len from --min 3 to --max 3 suits cp2, cp ring (at 3: train.seq_len=3 must be divisible by 4"),
    (["bench", "--write"], "add --table"),
    (["bench", "--runs", "3"], "add --table"),
    (["bench", "--table", "--runs", "0"], "give at least 1"),
    (["bench", "--table", "train.precision=bf16"], "bench.yaml's workload in their layouts, which this config "
                                                    "changes: train.precision=bf16 (bench.yaml: fp32); set them back"),
    (["bench", "--table", "parallel.cp=2"], "which this config changes: parallel.cp=2 (bench.yaml: 1); set"),
    (["bench", TINY, "--table"], "model.vocab_size=320 (bench.yaml: 2048), model.dim=64 (bench.yaml: 256)"),
    (["bench", "--budget-gb", "1"], "--budget-gb: only with --max-seq"),
    (["bench", TINY, "--budget-gb", "0"], "--budget-gb: only with --max-seq"),
    (["bench", "--max-seq", TINY, "--budget-gb", "1", "--runs", "2"], "--runs: not with --max-seq"),
    (["bench", "--max-seq", TINY, "--budget-gb", "1", "--steps", "0"], "--steps: not with --max-seq"),
    (["bench", "--steps", "0"], "--steps 0: the first 2 steps are not timed"),
    (["bench", TINY, "train.steps=4"], "train.steps=4: sixfold bench runs --steps N steps (default 10); give --steps"),
    (["bench", "--table", "train.steps=3"], "train.steps=3: sixfold bench runs --steps N steps"),
    (["bench", TINY, "train.micro_batches=3"], "(sixfold bench set train.global_batch=4, 4 sequences per data-parallel "
                                               "rank, as none was given)"),
    (["bench", "--max-seq", TINY, "--budget-gb", "-1"], "--budget-gb -1.0: give a positive, finite number of GB"),
    (["bench", "--max-seq", TINY, "--budget-gb", "inf"], "--budget-gb inf: give a positive, finite number of GB"),
    (["bench", "--max-seq", TINY, "--budget-gb", "1", "--max", "16"], "--min 32 (by default, train.seq_len) is "
                                                                       "above --max 16"),
    (["bench", TINY, "model.vocab_size=200"], "model.vocab_size=200 is smaller than the tokenizer's"),
    (["bench", "--max-seq", TINY, "data.source=/nonexistent", "--budget-gb", "1"], "/nonexistent does not exist"),
    (["bench", "--max-seq", TINY, "model.vocab_size=200", "--budget-gb", "1"], "model.vocab_size=200 is smaller"),
    (["bench", "--max-seq", TINY, "data.max_bytes=3000", "--budget-gb", "1", "--min", "8192"],
     "tokens, fewer than a sequence of the first length to probe, 8192 (--min 8192), and one more: lower --min, or "
     "give more text (or a larger data.max_bytes)"),
    *[(["bench", *flags, TINY, "data.tokenizer=bpe", "checkpoint.resume=auto"],  # a job never resumes: no BPE trained
       "data.bpe_vocab_size=2048 is more than model.vocab_size=320")
      for flags in ([], ["--max-seq", "--budget-gb", "1"])],
])
def test_bad_input_is_refused_before_any_job(capsys, monkeypatch, argv, message):
    from sixfold import bench
    for module in (bench, maxseq):
        monkeypatch.setattr(module, "launch", lambda *a: pytest.fail("a job started"))
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_stopping_bench_stops_its_job_and_removes_its_files(tmp_path):
    """SIGTERM to `sixfold bench` is passed on to the job it runs (torchrun and its ranks), and bench ends once
    the job has, with its temporary directory removed, instead of leaving the ranks training unseen."""
    cmd = [sys.executable, "-m", "sixfold.cli", "bench", TINY, "parallel.dp_replicate=2", "--steps", "100000"]
    bench = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while bench.poll() is None and not list(tmp_path.glob("sixfold-bench-*/run/config.yaml")):
        time.sleep(0.1)  # the ranks have built the model and started training
    job = next(tmp_path.glob("sixfold-bench-*"))
    bench.send_signal(signal.SIGTERM)
    out, err = bench.communicate(timeout=120)
    assert bench.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, err[-3000:]
    assert not job.exists()
    running = [p for p in Path("/proc").glob("[0-9]*") if str(job) in _cmdline(p)]
    assert not running


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
