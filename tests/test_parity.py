"""Every layout of the parity matrix (sixfold.matrix) reproduces the single-process run: fp32 losses and final
weights in round-off, bf16 learning like fp32. The matrix runs in one torchrun job; docs/parity.md, written by
`sixfold matrix --table`, must list its layouts. It covers every pair of dimensions. ZeRO's buffers and bytes
equal the formulas."""
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from sixfold import matrix
from sixfold.config import ConfigError, load_config
from helpers import ROOT, TINY, torchrun

DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """The whole matrix, once; its table is written beside the runs whatever the verdicts."""
    workdir = tmp_path_factory.mktemp("matrix")
    report = matrix.run(TINY, workdir=str(workdir))
    (workdir / "parity.md").write_text(report.table("sixfold matrix configs/tiny.yaml"))
    print(f"table: {workdir / 'parity.md'}")
    return {row.layout.name: row for row in report.rows}


@pytest.mark.parametrize("name", [layout.name for layout in matrix.LAYOUTS])
def test_parity(rows, name):
    row = rows[name]
    print(row.line())
    assert row.ok, row.line()


def test_a_passing_matrix_removes_its_temporary_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report = matrix.run(TINY, only=["dp2"])
    assert [row.ok for row in report.rows] == [True] and not report.kept and not list(tmp_path.iterdir())
    with pytest.raises(ConfigError):  # a layout refuses the setting: nothing ran, nothing is left
        matrix.run(TINY, ["model.n_heads=3"], only=["dp2"])
    assert not list(tmp_path.iterdir())
    for only, said in ((["dp2", "model.dim=abc"], "model.dim=abc is no layout; give the config and its overrides "
                                                  "before --only"), (["dp9"], "no layout named dp9 in the matrix")):
        with pytest.raises(ConfigError, match=said):
            matrix.run(TINY, only=only)


def test_a_signal_stops_the_whole_matrix(tmp_path):
    """SIGTERM while a layout trains ends the job: no later layout runs, none is reported failed, no table."""
    cmd = [sys.executable, "-m", "sixfold.cli", "matrix", TINY, "--only", "dp2", "tp2", "cp2-ring",
           "--workdir", str(tmp_path / "runs")]
    job = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    seen = [job.stdout.readline()]
    while not seen[-1].startswith("dp2: ok"):  # dp2's run has ended, tp2's starts
        assert seen[-1], "".join(seen) + job.stderr.read()[-3000:]
        seen.append(job.stdout.readline())
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, (out, err[-3000:])
    assert "FAILED" not in "".join(seen) + out
    ran = [json.loads(line)["name"] for line in (tmp_path / "runs" / "results.jsonl").read_text().splitlines()]
    assert "dp2" in ran and "tp2" not in ran and "cp2-ring" not in ran, ran


def test_docs_parity_lists_the_matrix():
    rows = [line for line in (ROOT / "docs" / "parity.md").read_text().splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0][2:] for row in rows] == [layout.name for layout in matrix.LAYOUTS], \
        "docs/parity.md is out of date: run `sixfold matrix configs/tiny.yaml --table docs/parity.md`"
    assert all(row.endswith("| ok |") for row in rows), "docs/parity.md records a failed layout"


def _parallel(layout):
    return load_config(TINY, list(layout.overrides)).parallel


def _dims(p) -> set[str]:
    return {d for d in DIMS if getattr(p, d) > 1}


def test_the_matrix_covers_every_pair_of_dimensions_and_the_big_combinations():
    layouts = {layout.name: _parallel(layout) for layout in matrix.LAYOUTS}
    used = [_dims(p) for p in layouts.values()]
    for pair in itertools.combinations(DIMS, 2):
        assert any(set(pair) <= dims for dims in used), f"no layout has both {pair}"
    assert len(layouts) >= 40 and max(p.world_size for p in layouts.values()) == 16
    assert {"pp", "dp_shard", "tp", "cp", "ep"} in used and {"pp", "dp_replicate", "dp_shard", "tp"} in used
    tp = [name for name, p in layouts.items() if p.tp > 1]
    assert all(layouts[n].sequence_parallel or "no-sequence-tp" in n for n in tp)
    assert any(p.cp_mode == "ulysses" and p.tp > 1 and p.pp > 1 for p in layouts.values())
    models = {layout.name: load_config(TINY, list(layout.overrides)).model for layout in matrix.LAYOUTS}
    padded = [n for n, p in layouts.items()
              if p.zero and models[n].vocab_size * models[n].dim % (16 * p.dp_shard * p.cp)]
    assert padded, "no ZeRO layout pads its flat buffers (the embedding's unit, at least)"
    for schedule in ("interleaved", "zb-v"):
        assert any(p.pp_schedule == schedule and p.tp > 1 and p.cp > 1 for p in layouts.values())


def test_a_checkpoint_crosses_four_dimensions_inside_the_matrix():
    moved = [layout for layout in matrix.LAYOUTS if layout.resumes]
    names = [layout.name for layout in matrix.LAYOUTS]
    assert moved
    for layout in moved:
        source = matrix.LAYOUTS[names.index(layout.resumes)]
        assert names.index(source.name) < names.index(layout.name)
        a, b = _parallel(source), _parallel(layout)
        assert len([d for d in DIMS if getattr(a, d) != getattr(b, d)]) >= 4


ZERO_CASES = ["0:fp32", "1:fp32", "2:fp32", "3:fp32", "3:fp32:once", "0:bf16", "1:bf16", "3:bf16"]


@pytest.fixture(scope="module")
def zero_job():
    """Every case of the ZeRO formulas, one after another in one job of 4 ranks."""
    return torchrun("zero_buffers.py", 4, *ZERO_CASES)


@pytest.mark.parametrize("case", ZERO_CASES)
def test_zero_memory_and_bytes_equal_the_formulas(zero_job, case):
    assert f"zero {case.replace(':', ' ')} buffers OK" in zero_job.stdout, zero_job.stderr[-3000:]
