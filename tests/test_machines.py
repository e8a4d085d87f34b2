"""Several machines, as torchrun starts them on a cluster: one agent per machine, meeting at a c10d rendezvous or
at the first machine's address (static, torchrun's default); here two agents on this host. The ranks' local ranks,
each machine's first rank and its marks in the agent's store are what differ from one machine of as many ranks."""
import os
import shutil
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from sixfold.config import load_config
from sixfold.join import _attempt_store
from sixfold.logs import read_metrics
from sixfold.train import train

from helpers import LONG, TINY, children, end_machines, machines, start_machines, torchrun
from test_train import _weights

HOST = socket.gethostname()
LAYOUT = ("parallel.pp=2", "parallel.dp_shard=2", "parallel.zero=3", "train.steps=3", "train.micro_batches=2")


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory) -> Path:
    """The run directory of LAYOUT on 4 ranks of one machine."""
    one = tmp_path_factory.mktemp("one")
    proc = torchrun("sixfold.cli", 4, "train", TINY, *LAYOUT, f"log.run_dir={one}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return one


@pytest.mark.parametrize("rdzv", ["c10d", "static"])
def test_two_machines_train_as_one(tmp_path, one_machine, rdzv):
    """2 machines x 2 ranks: the same losses and weights, bit for bit, as 4 ranks on one machine."""
    two, one = tmp_path / "two", one_machine
    for proc in machines(2, 2, "train", TINY, *LAYOUT, f"log.run_dir={two}", rdzv=rdzv):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["loss"] for m in read_metrics(two)] == [m["loss"] for m in read_metrics(one)]
    ours, theirs = _weights(two), _weights(one)
    assert ours.keys() == theirs.keys() and all(w.equal(theirs[name]) for name, w in ours.items())


def _errors(proc) -> list[str]:
    """The lines of a machine's output that give sixfold's errors."""
    return [line for line in proc.stderr.splitlines() if line.startswith("sixfold error")]


@pytest.mark.parametrize("rdzv", ["c10d", "static"])
def test_a_layout_error_is_said_once_a_machine(tmp_path, rdzv):
    """Every rank finds the layout impossible: each machine's first rank says so, once, naming no rank."""
    for proc in machines(2, 2, "train", TINY, "parallel.dp_shard=2", f"log.run_dir={tmp_path / 'run'}", rdzv=rdzv):
        assert proc.returncode != 0 and _errors(proc) == [
            "sixfold error: world size 4 does not equal pp*dp_replicate*dp_shard*cp*tp = 1*1*2*1*1 = 2; change the "
            "parallel.* sizes or start 2 ranks in all (torchrun's --nnodes times --nproc-per-node)"], \
            proc.stderr[-3000:]


def test_machines_launched_with_other_settings_are_refused(tmp_path):
    """A machine given another override than the first (or a config it lacks) stops every rank before any step,
    naming the settings; the cache directory may differ (each machine's own)."""
    run = tmp_path / "run"
    own = {1: ["train.lr=0.001", "train.steps=4", f"data.cache_dir={tmp_path / 'cache'}"]}
    for proc in machines(2, 1, "train", TINY, "parallel.dp_shard=2", f"log.run_dir={run}", own=own):
        assert proc.returncode != 0 and _errors(proc) == [
            "sixfold error: rank 1 was launched with another config than rank 0: train.steps=4 where rank 0 has 5; "
            "train.lr=0.001 where rank 0 has 0.003; give every machine's launch the same config file and overrides"], \
            proc.stderr[-3000:]
    assert not (run / "metrics.jsonl").exists()


def test_machines_that_see_other_checkpoints_are_refused(tmp_path):
    """Each machine reads checkpoint.resume on its own disk: one that finds another checkpoint there than the first
    machine (or none where it finds one) stops every rank before any step, naming both."""
    homes = [tmp_path / "n0", tmp_path / "n1"]
    for home, lr in zip(homes, ("0.003", "0.001")):
        train(load_config(TINY, [f"log.run_dir={home / 'base'}", "train.steps=2", f"train.lr={lr}"]))
    run = tmp_path / "run"
    for proc in machines(2, 1, "train", TINY, "parallel.dp_shard=2", "checkpoint.resume=base", f"log.run_dir={run}",
                         cwds=homes):
        assert proc.returncode != 0 and _errors(proc) == [
            f"sixfold error: rank 1 resumes from {homes[1] / 'base/checkpoints/step_0000002'} on {HOST}, rank 0 from "
            f"{homes[0] / 'base/checkpoints/step_0000002'} on {HOST}: another checkpoint (its meta.json differs); "
            f"every rank resumes from the same one: give checkpoint.resume a path that all machines share, or the "
            f"same copy on each"], proc.stderr[-3000:]
    assert not (run / "metrics.jsonl").exists()
    shutil.rmtree(homes[1] / "base")
    for proc in machines(2, 1, "train", TINY, "parallel.dp_shard=2", "checkpoint.resume=auto", "log.run_dir=base",
                         "checkpoint.every=0", "checkpoint.save_final=false", cwds=homes):
        assert proc.returncode != 0 and _errors(proc) == [
            f"sixfold error: rank 0 on {HOST} finds a checkpoint to resume from (checkpoint.resume=auto, "
            f"log.run_dir=base) and rank 1 on {HOST} none: every rank resumes from the same checkpoint; give "
            f"checkpoint.resume a path that all machines share, or the same copy on each"], proc.stderr[-3000:]


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


def _restarted(agents, gone: tuple[int, ...]) -> list[str]:
    """Each agent's TORCHELASTIC_RESTART_COUNT for its rank started after the `gone` ones, once it has started."""
    ranks = [_until(lambda: [r for r in children(a.pid) if r not in gone], "a restart")[0] for a in agents]
    return [_until(lambda: _restart_count(r), "a rank's start") for r in ranks]


def _restartable(run: Path, rdzv: str = "c10d") -> list:
    """2 machines of 1 rank on the LONG run, resumed from its checkpoints (every 3 steps) after a restart; a rank
    that waits on a lost peer gives up within 60 s."""
    return start_machines(2, 1, "train", TINY, f"log.run_dir={run}", "checkpoint.resume=auto", "checkpoint.every=3",
                          "parallel.timeout_s=60", *LONG, restarts=1, rdzv=rdzv)


def _steps_written(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _end_as_never_stopped(agents, run: Path, uninterrupted: float) -> None:
    """The restarted machines end well, with every step's metrics and the loss of a run that nothing stopped."""
    outputs = [a.communicate(timeout=300) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs[0][1][-3000:]
    steps = read_metrics(run)  # steps after the last checkpoint may appear twice
    assert sorted({m["step"] for m in steps}) == list(range(1, 31))
    assert steps[-1]["loss"] == uninterrupted


def test_a_rank_killed_on_one_machine_restarts_both_which_resume_as_if_never_stopped(tmp_path, uninterrupted):
    """torchrun --max-restarts on 2 machines of 1 rank: SIGKILL the second machine's rank mid-run. The first
    machine's rank is paused meanwhile, so that its agent stops it because the other machine asks to meet again
    (then it is killed too): a restart that agent does not count, so the machines' TORCHELASTIC_RESTART_COUNT
    differ. Both meet again, and the job resumes from the latest checkpoint and ends with the uninterrupted run's
    loss."""
    run = tmp_path / "run"
    agents = _restartable(run)
    try:
        _until(lambda: _steps_written(run) >= 3, "3 steps")
        assert all(a.poll() is None for a in agents)
        (paused,), (killed,) = (children(a.pid) for a in agents)
        os.kill(paused, signal.SIGSTOP)
        os.kill(killed, signal.SIGKILL)
        _until(lambda: _pending(paused) & 1 << signal.SIGTERM - 1, "the first agent stopping its rank")
        os.kill(paused, signal.SIGKILL)
        assert _restarted(agents, (paused, killed)) == ["0", "1"]
        _end_as_never_stopped(agents, run, uninterrupted)
    finally:
        end_machines(agents)


def test_static_rendezvous_a_killed_rank_restarts_both_which_resume_as_if_never_stopped(tmp_path, uninterrupted):
    """torchrun's default rendezvous, 2 machines of 1 rank: SIGKILL the second machine's rank mid-run. No agent
    restarts for another's ranks here: the first machine's rank fails in its next collective with the killed one,
    then each agent restarts its own; the job resumes from the latest checkpoint, to the uninterrupted run's loss."""
    run = tmp_path / "run"
    agents = _restartable(run, "static")
    try:
        _until(lambda: _steps_written(run) >= 3, "3 steps")
        assert all(a.poll() is None for a in agents)
        (first,), (killed,) = (children(a.pid) for a in agents)
        os.kill(killed, signal.SIGKILL)
        assert _restarted(agents, (first, killed)) == ["1", "1"]
        _end_as_never_stopped(agents, run, uninterrupted)
    finally:
        end_machines(agents)


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
