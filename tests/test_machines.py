"""Several machines, as torchrun starts them on a cluster: one agent per machine, meeting at a c10d rendezvous
(here two agents on this host). The ranks' local ranks, each machine's first rank and its marks in the agent's
store are what differ from one machine of as many ranks."""
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from sixfold.logs import read_metrics
from sixfold.join import _attempt_store

from helpers import LONG, TINY, children, end_machines, machines, start_machines, torchrun
from test_train import _weights

LAYOUT = ("parallel.pp=2", "parallel.dp_shard=2", "parallel.zero=3", "train.steps=3", "train.micro_batches=2")


def test_two_machines_train_as_one(tmp_path):
    """2 machines x 2 ranks: the same losses and weights, bit for bit, as 4 ranks on one machine."""
    two, one = tmp_path / "two", tmp_path / "one"
    for proc in machines(2, 2, "train", TINY, *LAYOUT, f"log.run_dir={two}"):
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = torchrun("sixfold.cli", 4, "train", TINY, *LAYOUT, f"log.run_dir={one}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["loss"] for m in read_metrics(two)] == [m["loss"] for m in read_metrics(one)]
    ours, theirs = _weights(two), _weights(one)
    assert ours.keys() == theirs.keys() and all(w.equal(theirs[name]) for name, w in ours.items())


def test_a_layout_error_is_said_once_a_machine(tmp_path):
    """Every rank finds the layout impossible: each machine's first rank says so, once, naming no rank."""
    for proc in machines(2, 2, "train", TINY, "parallel.dp_shard=2", f"log.run_dir={tmp_path / 'run'}"):
        assert proc.returncode != 0
        said = [line for line in proc.stderr.splitlines() if line.startswith("sixfold error")]
        assert said == ["sixfold error: world size 4 does not equal pp*dp_replicate*dp_shard*cp*tp = 1*1*2*1*1 = 2; "
                        "change the parallel.* sizes or start 2 ranks in all (torchrun's --nnodes times "
                        "--nproc-per-node)"], proc.stderr[-3000:]




def _pending(pid: int) -> int:
    """The signals waiting for process `pid` (a stopped one does not take them), as a bit mask."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)


def _until(done, what: str, seconds: float = 120):
    """Poll done() until it gives something true; that."""
    deadline = time.monotonic() + seconds
    while not (out := done()):
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.05)
    return out


def _restart_count(pid: int) -> str:
    """The TORCHELASTIC_RESTART_COUNT its agent gave rank process `pid` ("" until it has exec'd)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"TORCHELASTIC_RESTART_COUNT=")), "")


def test_a_rank_killed_on_one_machine_restarts_both_which_resume_as_if_never_stopped(tmp_path, uninterrupted):
    """torchrun --max-restarts on 2 machines of 1 rank: SIGKILL the second machine's rank mid-run. The first
    machine's rank is paused meanwhile, so that its agent stops it because the other machine asks to meet again
    (then it is killed too): a restart that agent does not count, so the machines' TORCHELASTIC_RESTART_COUNT
    differ. Both meet again, and the job resumes from the latest checkpoint and ends with the uninterrupted run's
    loss."""
    run = tmp_path / "run"
    agents = start_machines(2, 1, "train", TINY, f"log.run_dir={run}", "checkpoint.resume=auto", "checkpoint.every=3",
                            *LONG, restarts=1)
    metrics = run / "metrics.jsonl"
    try:
        _until(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3, "3 steps")
        assert all(a.poll() is None for a in agents)
        (paused,), (killed,) = (children(a.pid) for a in agents)
        os.kill(paused, signal.SIGSTOP)
        os.kill(killed, signal.SIGKILL)
        _until(lambda: _pending(paused) & 1 << signal.SIGTERM - 1, "the first agent stopping its rank")
        os.kill(paused, signal.SIGKILL)
        ranks = [_until(lambda: [r for r in children(a.pid) if r not in (paused, killed)], "a restart")[0]
                 for a in agents]
        assert [_until(lambda: _restart_count(r), "a rank's start") for r in ranks] == ["0", "1"]
        outputs = [a.communicate(timeout=300) for a in agents]
    finally:
        end_machines(agents)
    assert [a.returncode for a in agents] == [0, 0], outputs[0][1][-3000:]
    steps = read_metrics(run)  # steps after the last checkpoint may appear twice
    assert sorted({m["step"] for m in steps}) == list(range(1, 31))
    assert steps[-1]["loss"] == uninterrupted


@pytest.mark.parametrize("first", [0, 1])
def test_a_start_is_numbered_alike_on_every_rank_whatever_an_earlier_one_left(monkeypatch, first):
    """In the agent's store, an earlier start's rank 1 ended before reading its post (number 7). Whichever of rank 0
    and rank 1 comes first, both take this start's number (8) and so share its keys."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    timeout = timedelta(seconds=30)
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout)
    agent.add("sixfold/attempts", 7)
    agent.set("sixfold/attempt_for/1", "7")
    keys = {}

    def start(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", agent.port, is_master=False, timeout=timeout)
        keys[rank] = _attempt_store(store, rank, 2, timeout)

    ranks = [threading.Thread(target=start, args=(r,)) for r in (first, 1 - first)]
    for r in ranks:
        r.start()
        time.sleep(0.2)
    for r in ranks:
        r.join()
    keys[0].set("address", "rank 0's")
    assert keys[1].get("address") == b"rank 0's" and agent.check(["sixfold/attempt_8/address"])
