"""bench/: the end-to-end comparison's two sides compute the same steps; bench/run_all.py's summary reads the
ratios back from docs/benchmarks.md."""
import os
import subprocess
import sys
import time

import pytest

from helpers import ROOT, TINY

sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402
import run_all  # noqa: E402


@pytest.mark.parametrize("world", [1, 4])
def test_e2e_sides_compute_the_same_steps(world):
    """On the test model, each side a torchrun job of 3 steps (bench/e2e.py): 1 process, sixfold's trainer and a
    plain PyTorch loop; dp_shard=2 x tp=2, sixfold's ZeRO-3 trainer and FSDP2 over DTensor TP+SP."""
    losses = {}
    for side in ("sixfold", "composed"):
        ranks, _ = common.torchrun(ROOT / "bench" / "e2e.py", world, "--worker", side, "--steps", "3", "--config", TINY)
        assert len(ranks) == world and all(r["peak_mb"] > 0 and len(r["step_s"]) == 3 for r in ranks)
        losses[side] = ranks[0]["loss"]
    assert losses["composed"] == pytest.approx(losses["sixfold"], rel=1e-5), losses


SECTION = """# Benchmarks

Intro.

## Data parallel: sixfold vs DDP

<!-- dp:begin -->
Command: `python bench/dp.py --ranks 2 4 --runs 5`  
sixfold: commit abc1234  
Date: 2026-01-02; 5 alternating run(s) per layout

| layout | sixfold s/step | DDP s/step | time ratio | sixfold peak MB | DDP peak MB | memory ratio |
|---|---|---|---|---|---|---|
| dp_replicate=2 (2 ranks) | 0.639 (0.609-0.729) | 0.637 (0.603-0.747) | **1.004** | 426 (423-430) | 485 (480-487) | **0.877** |
| dp_replicate=4 (4 ranks) | 1.316 (1.265-1.495) | 1.336 (1.263-1.467) | **0.985** | 422 (419-425) | 479 (474-522) | **0.881** |
<!-- dp:end -->
"""


def test_summary_goes_under_the_title_and_is_replaced_next_time(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(SECTION)
    body = run_all.summary(doc.read_text(), {"dp": "written now"}, "python bench/run_all.py --only dp")
    run_all.write_summary(body, doc)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## Summary\n\n<!-- summary:begin -->\nWritten by `python bench/run_all.py "
                           "--only dp`"), text
    assert ("| [Data parallel](#data-parallel-sixfold-vs-ddp) | DDP | dp_replicate=2 (2 ranks) 1.004; dp_replicate=4 "
            "(4 ranks) 0.985 | dp_replicate=2 (2 ranks) 0.877; dp_replicate=4 (4 ranks) 0.881 | 2026-01-02, commit "
            "abc1234 (written now) |") in text
    assert "| End to end | torch's parts composed as in torchtitan | - | - | not measured yet |" in text
    assert text.endswith(SECTION.split("Intro.", 1)[1]) and "Intro." in text
    run_all.write_summary("again", doc)
    text = doc.read_text()
    assert text.count("<!-- summary:begin -->") == 1 and "again" in text and "Written by" not in text


def test_every_section_in_the_docs_gives_numbers():
    """The summary's parsing against the tables as the benchmarks write them (a section without a table yet, or
    not there yet, gives nothing)."""
    text = run_all.DOC.read_text()
    seen = 0
    for name, spec in {**run_all.COMPARISONS, **run_all.WITHIN}.items():
        body = run_all.section(text, name)
        if body is None or "|---" not in body:
            continue
        found = run_all.ratios(body, spec)
        assert found, name
        for label, *values in found:
            assert label and all(v == "-" or float(v) > 0 for v in values), (name, label, values)
        assert run_all.heading(text, name), name
        seen += 1
    assert seen >= 8
    pp = run_all.ratios(run_all.section(text, "pp"), run_all.COMPARISONS["pp"])
    schedules = ["gpipe", "1f1b", "interleaved", "breadth-first", "zb-v"]
    assert [label for label, *_ in pp] == [f"pp={n}, {s}" for n in (2, 4) for s in schedules]


def test_collectives_section_gives_its_command_and_date(monkeypatch):
    """bench/collectives.py's section names the command as run (run_all's quick one here) and its date, which the
    summary reads back."""
    import collectives

    monkeypatch.setattr(sys, "argv", ["bench/collectives.py", "--ranks", "2", "--blocks", "1", "--write"])
    args = type("Args", (), {"blocks": 1, "repeats": 10})
    body = collectives.report({2: [{"kb": 256, "torch": 0.002, "sixfold": 0.001, "error": 1e-7}]}, args)
    assert body.startswith("Command: `python bench/collectives.py --ranks 2 --blocks 1 --write`  \n"), body
    assert run_all.measured(body).startswith(time.strftime("%Y-%m-%d") + ", commit "), body
    assert run_all.ratios(body, run_all.COMPARISONS["collectives"]) == [("2 ranks, 256 KB", "0.500", "-")]


def test_torchtitan_comparison_reads_step_times_and_is_skipped_without_torchtitan():
    """bench/vs_torchtitan.py: a run's time from the stamps of torchtitan's step lines (colour codes and all);
    without a Python that has torchtitan it says what to give and exits with run_all's SKIPPED."""
    import peers
    import vs_torchtitan

    log = "".join(f"[titan] 2026-11-30 04:49:{40 + i // 4:02d},{250 * (i % 4):03d} - root - INFO - \x1b[31mstep: "
                  f"{i:2}  \x1b[32mloss:  7.9\n" for i in range(1, 11))
    assert vs_torchtitan.step_time(log, 10) == pytest.approx(0.25)
    assert vs_torchtitan.step_time(log, 12) is None
    env = {k: v for k, v in os.environ.items() if k != "TORCHTITAN_PYTHON"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vs_torchtitan.py")], env=env, text=True,
                          capture_output=True)
    assert proc.returncode == run_all.SKIPPED == peers.SKIPPED, proc.stderr
    assert proc.stdout.startswith("skipped") and "--python" in proc.stdout


def test_torchtitan_comparison_takes_each_sides_fastest_way_and_its_memory():
    """bench/vs_torchtitan.py: sixfold's other ways of a row (ZeRO-1 for data parallelism, ZB-H1 for pipelining);
    the time ratio divides each side's fastest way, the memory ratio those same ways' largest-rank peaks, which
    the summary reads back."""
    import peers
    import vs_torchtitan
    from sixfold.bench import TABLE

    ways = {x.name: vs_torchtitan.other_ways(x) for x in TABLE}
    assert ways["1 process"] == [] and ways["tp 2"] == []
    assert [w for w, _ in ways["dp 2"]] == ["ZeRO-1"] and "parallel.dp_shard=2" in ways["dp 2"][0][1]
    assert ways["pp 2 (4 micro-batches)"] == [("ZB-H1", ("parallel.pp=2", "parallel.pp_schedule=zb-h1",
                                                         "train.micro_batches=4"))]
    assert [w for w, _ in ways["dp2 x pp2"]] == ["ZeRO-1", "ZB-H1"]

    def run(step_s, *peaks):
        return {"step_s": step_s, "peak_mb": list(peaks), "others": 0.0}
    row = {("sixfold", ""): [run(0.5, 100, 120)], ("sixfold", "ZB-H1"): [run(0.4, 110, 150)],
           ("torchtitan", "interleaved"): [run(0.6, 170, 200)], ("torchtitan", "zero bubble"): [run(0.5, 180, 190)]}
    args = type("Args", (), {"runs": 1, "steps": 10})
    peer = peers.Peer("torchtitan", "0.3.0", "vs_torchtitan.py", 1, vs_torchtitan.NOT_RUN, "")
    body = peers.report({"pp 2 (4 micro-batches)": row}, args, "commit abc", peer)
    line = next(x for x in body.splitlines() if x.startswith("| pp 2"))
    assert "**0.80**" in line and "| 120, 150 (ZB-H1) | 200 (interleaved), 190 (zero bubble) | 0.79 |" in line
    found = run_all.ratios(body, run_all.COMPARISONS["torchtitan"])
    assert found[0] == ("pp 2 (4 micro-batches)", "0.80", "0.79")


def test_deepspeed_comparison_rows_and_skipped_without_deepspeed():
    """bench/vs_deepspeed.py: the rows issue #11 gives DeepSpeed a time in, sixfold's ZeRO-3 beside the table's way
    in the data-parallel ones; without a Python that has DeepSpeed it exits with run_all's SKIPPED."""
    import vs_deepspeed
    from sixfold.bench import TABLE

    assert {x.name for x in TABLE if x.peers[2] != "-"} == set(vs_deepspeed.RANKS)
    ways = {x.name: vs_deepspeed.other_ways(x) for x in TABLE if x.name in vs_deepspeed.RANKS}
    assert ways == {"1 process": [], "dp 2": [("ZeRO-3", ("parallel.dp_shard=2", "parallel.zero=3"))],
                    "dp 4": [("ZeRO-3", ("parallel.dp_shard=4", "parallel.zero=3"))]}
    env = {k: v for k, v in os.environ.items() if k != "DEEPSPEED_PYTHON"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vs_deepspeed.py")], env=env, text=True,
                          capture_output=True)
    assert proc.returncode == run_all.SKIPPED, proc.stderr
    assert proc.stdout.startswith("skipped") and "DEEPSPEED_PYTHON" in proc.stdout


def test_cp_documents_jobs_go_first_in_turn():
    """bench/cp.py --documents: a row's causal (0) and within-documents jobs, either first in every other row, and
    each layout's order swapped from one length to the next (4 layouts at 2 lengths)."""
    import cp

    orders = [[cp.turns(i + j, 100) for j in range(4)] for i in range(2)]
    assert orders == [[(0, 100), (100, 0), (0, 100), (100, 0)], [(100, 0), (0, 100), (100, 0), (0, 100)]]


@pytest.mark.parametrize("change, message", [
    ({"seq": [32, 30]}, "--seq 30 at --cp 2 in mode ring: train.seq_len=30 must be divisible by 4"),
    ({"cp": 1}, "--cp 1: give at least 2"),
    ({"repeats": 0}, "--repeats 0: give at least 1"),
    ({"documents": -1}, "--documents -1: give at least 0"),
    ({"seq": [0]}, "--seq 0: give at least 1"),
    ({"config": "/nonexistent"}, "/nonexistent does not exist"),
    ({}, None),
    ({"seq": [512], "cp": 4}, None),  # beyond the config's model.max_seq_len (256): it only sizes the RoPE tables
])
def test_cp_refuses_what_its_jobs_cannot_run(change, message):
    """bench/cp.py's arguments, checked before any job: a length its zigzag chunks do not divide made the cp ranks'
    collectives mismatch (gloo aborted the job after the cp=1 one had run)."""
    from types import SimpleNamespace

    import cp

    args = {"cp": 2, "repeats": 1, "documents": 0, "seq": [32], "modes": ["ring", "ulysses"], "config": TINY, **change}
    said = cp.refused(SimpleNamespace(**args))
    assert said == message if message is None else message in said, said


@pytest.mark.parametrize("script, change, message", [
    ("tp", {"ranks": [2, 3]}, "--ranks 3: model.n_heads=16 is not divisible by parallel.tp=3"),
    ("dp", {"ranks": [0]}, "--ranks 0: give at least 1"),
    ("dp", {"runs": 0}, "--runs 0: give at least 1"),
    ("fsdp", {"config": "/nonexistent"}, "config file /nonexistent does not exist"),
    *[(script, {}, None) for script in ("dp", "fsdp", "tp", "e2e")],  # each one's defaults run
])
def test_a_side_by_side_benchmark_refuses_what_its_jobs_cannot_run(script, change, message):
    """Checked before any job (common.check): tp.py --ranks 2 3 ran its 2-rank jobs before a worker refused 3; --runs 0
    failed on the empty list of runs (IndexError), a missing --config with a traceback."""
    import importlib
    from types import SimpleNamespace

    from sixfold.config import ConfigError

    bench = importlib.import_module(script).BENCH
    args = SimpleNamespace(**{"ranks": list(bench.ranks), "runs": 1, "steps": 3,
                              "config": str(ROOT / "configs" / "bench.yaml"), **change})
    if message is None:
        common.check(bench, args)
    else:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            common.check(bench, args)
