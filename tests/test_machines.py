"""Several machines, as torchrun starts them on a cluster: one agent per machine, meeting at a c10d rendezvous
(here two agents on this host). The ranks' local ranks, each machine's first rank and its marks in the agent's
store are what differ from one machine of as many ranks."""
import os
import signal
import time
from pathlib import Path

from sixfold.logs import read_metrics

from helpers import LONG, TINY, machines, start_machines, torchrun
from test_train import _children, _weights

LAYOUT = ("parallel.pp=2", "parallel.dp_shard=2", "parallel.zero=3", "train.steps=3", "train.micro_batches=2")


def test_two_machines_train_as_one(tmp_path):
    """2 machines x 2 ranks: the same losses and weights, bit for bit, as 4 ranks on one machine."""
    two, one = tmp_path / "two", tmp_path / "one"
    for proc in machines(2, 2, "train", TINY, *LAYOUT, f"log.run_dir={two}"):
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = torchrun("sixfold.cli", 4, "train", TINY, *LAYOUT, f"log.run_dir={one}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["loss"] for m in read_metrics(two)] == [m["loss"] for m in read_metrics(one)]
    theirs = _weights(one)
    assert all(w.equal(theirs[name]) for name, w in _weights(two).items())


def test_a_layout_error_is_said_once_a_machine(tmp_path):
    """Every rank finds the layout impossible: each machine's first rank says so, once, naming no rank."""
    for proc in machines(2, 2, "train", TINY, "parallel.dp_shard=2", f"log.run_dir={tmp_path / 'run'}"):
        assert proc.returncode != 0
        said = [line for line in proc.stderr.splitlines() if line.startswith("sixfold error")]
        assert said == ["sixfold error: world size 4 does not equal pp*dp_replicate*dp_shard*cp*tp = 1*1*2*1*1 = 2; "
                        "change the parallel.* sizes or start 2 ranks in all (torchrun's --nnodes times --nproc-per-node)"], proc.stderr[-3000:]




def _pending(pid: int) -> int:
    """The signals waiting for process `pid` (a stopped one does not take them), as a bit mask."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)


def test_a_rank_killed_on_one_machine_restarts_both_which_resume_as_if_never_stopped(tmp_path, uninterrupted):
    """torchrun --max-restarts on 2 machines of 1 rank: SIGKILL the second machine's rank mid-run. The first
    machine's rank is paused meanwhile, so that its agent stops it because the other machine asks to meet again,
    a restart it does not count: the machines' TORCHELASTIC_RESTART_COUNT differ (it is killed as it is stopped).
    Both meet again, and the job resumes from the latest checkpoint and ends with the uninterrupted run's loss."""
    run = tmp_path / "run"
    agents = start_machines(2, 1, "train", TINY, f"log.run_dir={run}", "checkpoint.resume=auto", "checkpoint.every=3",
                            *LONG, restarts=1)
    metrics = run / "metrics.jsonl"
    while all(a.poll() is None for a in agents) and not (metrics.is_file() and
                                                          len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    (paused,), (killed,) = (_children(a.pid) for a in agents)
    os.kill(paused, signal.SIGSTOP)
    os.kill(killed, signal.SIGKILL)
    while not _pending(paused) & 1 << signal.SIGTERM - 1:  # its agent is stopping it
        time.sleep(0.05)
    os.kill(paused, signal.SIGKILL)
    outputs = [a.communicate(timeout=300) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs[0][1][-3000:]
    steps = read_metrics(run)  # steps after the last checkpoint may appear twice
    assert sorted({m["step"] for m in steps}) == list(range(1, 31))
    assert steps[-1]["loss"] == uninterrupted
