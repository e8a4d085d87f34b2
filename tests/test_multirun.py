"""Runs of several layouts in one torchrun job: a run that fails is reported and the job goes on."""
import json

from sixfold.config import load_config
from sixfold.launch import run_torchrun
from sixfold.logs import read_metrics
from helpers import TINY, torchrun


def _plan(tmp_path):
    """A run that fails, and two that follow it (one traced: its watcher thread must end too)."""
    def run(name, *overrides):
        cfg = load_config(TINY, ["train.steps=2", f"log.run_dir={tmp_path / name}", *overrides])
        return {"name": name, "config": cfg.to_dict()}

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"timeout_s": 30, "runs": [
        run("broken", "parallel.tp=2", f"checkpoint.resume={tmp_path / 'nowhere'}"),
        run("after", "parallel.tp=2", "log.trace=true"),
        run("alone"),
    ]}))
    return plan


def test_a_failing_run_is_reported_and_the_next_runs_go_on(tmp_path):
    proc = run_torchrun(2, [str(_plan(tmp_path))], capture=True, module="sixfold.multirun")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["name"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert not results["broken"]["ok"] and "does not exist" in results["broken"]["error"]
    assert "CheckpointError" in results["broken"]["error"].splitlines()[0]
    assert results["after"]["ok"] and results["alone"]["ok"]
    assert len(read_metrics(tmp_path / "after")) == 2 and len(read_metrics(tmp_path / "alone")) == 2


def test_no_process_group_thread_outlives_the_job(tmp_path):
    """Every group is freed when the job ends (no hook, cycle or default argument keeps one), so none of its
    worker threads can release a collective's tensors while the interpreter exits."""
    proc = torchrun("leave.py", 2, str(_plan(tmp_path)))
    assert proc.returncode == 0 and proc.stdout.count("threads OK") == 2, proc.stderr[-3000:]
