"""Runs of several layouts in one torchrun job: a run that fails is reported and the job goes on."""
import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist

from sixfold import multirun
from sixfold.config import load_config
from sixfold.launch import run_torchrun
from sixfold.logs import read_metrics
from helpers import ROOT, TINY, torchrun


def _plan(tmp_path):
    """A run that fails, and two that follow it (one traced: its watcher thread must end too)."""
    def run(name, *overrides):
        return name, load_config(TINY, ["train.steps=2", f"log.run_dir={tmp_path / name}", *overrides])

    plan = tmp_path / "plan.json"
    multirun.write_plan(plan, [run("broken", "parallel.tp=2", f"checkpoint.resume={tmp_path / 'nowhere'}"),
                      run("after", "parallel.tp=2", "log.trace=true"), run("alone")], 30)
    return plan


def test_a_failing_run_is_reported_and_the_next_runs_go_on(tmp_path):
    proc = run_torchrun(2, [str(_plan(tmp_path))], capture=True, module="sixfold.multirun")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = multirun.read_results(tmp_path / "plan.json")
    assert not results["broken"]["ok"] and "does not exist" in results["broken"]["error"]
    assert "CheckpointError" in results["broken"]["error"].splitlines()[0]
    assert results["after"]["ok"] and results["alone"]["ok"]
    assert len(read_metrics(tmp_path / "after")) == 2 and len(read_metrics(tmp_path / "alone")) == 2


def test_no_process_group_thread_outlives_the_job(tmp_path):
    """Every group is freed when the job ends (no hook, cycle or default argument keeps one), so none of its
    worker threads can release a collective's tensors while the interpreter exits."""
    proc = torchrun("leave.py", 2, str(_plan(tmp_path)))
    assert proc.returncode == 0 and proc.stdout.count("threads OK") == 2, proc.stderr[-3000:]


def test_a_signal_ends_the_job_not_the_run_alone(tmp_path):
    """SIGTERM while a run trains stops it and the job: the runs after it do not start, none is reported."""
    def run(name, steps):
        return name, load_config(TINY, [f"train.steps={steps}", "parallel.tp=2", f"log.run_dir={tmp_path / name}"])

    plan = tmp_path / "plan.json"
    multirun.write_plan(plan, [run("long", 100000), run("after", 2)], 30)
    cmd = [sys.executable, "-m", "sixfold.launch", "--standalone", "--nproc-per-node=2", "-m", "sixfold.multirun",
           str(plan)]
    job = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = tmp_path / "long" / "metrics.jsonl"
    while job.poll() is None and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.05)  # two steps done: the run is training
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert "sixfold multirun: stopped by SIGTERM" in err, err[-3000:]
    assert (tmp_path / "results.jsonl").read_text() == "" and not (tmp_path / "after").exists(), out + err[-3000:]


def test_a_run_said_done_is_on_disk_already(tmp_path, monkeypatch):
    """Each run's line is printed once its outcome is in results.jsonl: a signal that ends the job right after the
    line (between runs a rank ends at once) loses no outcome that was said."""
    results, said = tmp_path / "results.jsonl", []
    monkeypatch.setattr("builtins.print", lambda *args, **kwargs: said.append(results.read_text().count("\n")))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        multirun._report(results, [(name, {"ok": True, "seconds": 1.0}) for name in ("a", "b")])
    finally:
        dist.destroy_process_group()
    assert said == [2, 2], said
