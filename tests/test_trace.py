"""One traced pp2 x tp2 run (4 ranks, 1F1B over 4 micro-batches, 3 steps, evaluation at steps 2 and 3): its
trace.json is Chrome trace format with one track per rank, its pictures are drawn and `sixfold trace` redraws
them, and every rank's ledger gives each training step the bytes of the formulas in docs/guide."""
import json
import math
import re
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from PIL import Image

from sixfold import ledger
from sixfold.cli import main
from sixfold.config import RUN_CONFIG_HEAD, load_config
from sixfold.logs import read_metrics
from sixfold.pictures import LEGEND, PICTURES, _arc, _legend, draw_timeline
from sixfold.trace import overlap, overlap_table, read_chrome_trace, write_chrome_trace
from sixfold.train import train
from helpers import TINY, sixfold, torchrun

STEPS, MICRO, PP, TP = 3, 4, 2, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("traced") / "run"
    proc = sixfold("train", TINY, f"parallel.pp={PP}", f"parallel.tp={TP}", f"train.micro_batches={MICRO}",
                   f"train.steps={STEPS}", "train.eval_every=2", "log.trace=true", f"log.run_dir={run_dir}",
                   "log.sample_tokens=4", "checkpoint.save_final=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc.stdout + proc.stderr


def test_trace_is_chrome_format_with_a_track_per_rank(run):
    trace = json.loads((run[0] / "trace.json").read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list)
    spans = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["name"], str) and e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    assert all((e["tid"] == 0) == (e["cat"] != "comm") for e in spans)
    for rank, row in {(e["pid"], e["tid"]) for e in spans if e["tid"]}:  # collectives in flight together: own rows
        lane = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if (e["pid"], e["tid"]) == (rank, row))
        assert all(end <= start for (_, end), (start, _) in zip(lane, lane[1:])), (rank, row)
    names = [(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert sorted(names) == [(r, f"rank {r}") for r in range(PP * TP)]
    assert {e["pid"] for e in events} == set(range(PP * TP))
    assert {e["args"]["step"] for e in spans} == set(range(1, STEPS + 1))
    comm = [e for e in spans if e["cat"] == "comm"]
    assert comm and all({"group", "op", "bytes"} <= e["args"].keys() for e in comm)
    assert {e["args"]["group"] for e in comm} >= {"tp", "pp"}


def test_pictures_are_drawn_and_redrawn(run, capsys):
    run_dir = run[0]
    sizes = {}
    for name in PICTURES:
        path = run_dir / name
        assert path.stat().st_size > 10_000, name
        with Image.open(path) as image:
            sizes[name] = image.size
        assert sizes[name][0] >= 500 and sizes[name][1] >= 300, (name, sizes[name])
        path.unlink()
    assert main(["trace", str(run_dir)]) == 0  # in this process: a new one would spend seconds importing torch
    out = capsys.readouterr().out
    assert "asynchronous communication hidden behind compute" in out
    for name in PICTURES:
        assert f"wrote {run_dir / name}" in out
        with Image.open(run_dir / name) as image:
            assert image.size == sizes[name], name
    mesh = run_dir / "mesh.png"
    mesh.unlink()
    mesh.mkdir()  # in a picture's way: one line, not a traceback
    assert main(["trace", str(run_dir)]) == 2
    assert f"cannot draw {run_dir}'s pictures: [Errno 21] Is a directory: '{mesh}'" in capsys.readouterr().err
    mesh.rmdir()
    trace = run_dir / "trace.json"
    denied = PermissionError(13, "Permission denied", str(trace))  # a file it may not read (chmod does not stop root)
    with mock.patch("sixfold.pictures.read_chrome_trace", side_effect=denied):
        assert main(["trace", str(run_dir)]) == 2
    assert f"cannot read {trace}: Permission denied; make it readable" in capsys.readouterr().err
    ledger = run_dir / "comm_ledger.json"
    ledger.rename(run_dir / "ledger.json")  # mesh.png then stays as it was: said, not passed over
    mesh.write_bytes(b"an earlier run's picture")
    try:
        assert main(["trace", str(run_dir)]) == 0
    finally:
        (run_dir / "ledger.json").rename(ledger)
    assert f"kept {mesh}, not redrawn: the run has no comm_ledger.json" in capsys.readouterr().out
    timeline = run_dir / "timeline.png"
    trace.rename(run_dir / "events.json")  # a run trained without log.trace: its missing picture is said too
    timeline.unlink()
    try:
        assert main(["trace", str(run_dir)]) == 0
    finally:
        (run_dir / "events.json").rename(trace)
    assert "no timeline.png: the run has no trace.json (or no events in it) to draw it from (train with " \
           "log.trace=true)" in capsys.readouterr().out
    assert main(["trace", str(run_dir)]) == 0 and mesh.stat().st_size > 10_000 and timeline.is_file()


def test_a_large_meshs_legend_names_a_few_groups_and_sums_up_the_others():
    """128 ranks in tp groups of 4 listed each would be 32 lines, past the panel, over the next one."""
    groups, sizes = [tuple(range(4 * i, 4 * i + 4)) for i in range(32)], [4096.0] * 31 + [8192.0]
    rows = _legend(groups, sizes)
    assert rows[:2] == ["ranks 0,1,2,3: 4.0 KiB", "ranks 4,5,6,7: 4.0 KiB"] and len(rows) == LEGEND + 1
    assert rows[-1] == f"and {32 - LEGEND} more groups: 4.0 KiB to 8.0 KiB each"
    few = groups[:LEGEND + 1]
    assert _legend(few, sizes) == [f"ranks {','.join(map(str, g))}: 4.0 KiB" for g in few]
    assert _legend([tuple(range(0, 256, 4))], [100.0]) == ["ranks 0,4,...,252 (64 ranks): 100 B"]


def test_a_meshs_lines_bow_within_their_panel():
    """A line's arc passes rad / 2 of its length off the straight line: at rad 0.3 one across 64 boxes (pp groups of
    a 128-rank mesh) bowed 10 boxes down, through the legend; at most 0.6 of a box now, short ones as they were."""
    def bow(a, z):  # the curve's middle, off the straight line's
        v = _arc(a, z).vertices
        return math.dist(0.25 * v[0] + 0.5 * v[1] + 0.25 * v[2], ((a[0] + z[0]) / 2, (a[1] + z[1]) / 2))

    assert math.isclose(bow((0, 0), (1, 0)), 0.15) and math.isclose(bow((0, 0), (0, -2.6)), 0.15 * 2.6)
    for far in (5, 20, 64, 300):
        assert math.isclose(bow((0, 0), (far, 0)), 0.6)


def test_the_timelines_margins_do_not_grow_with_the_ranks(tmp_path):
    """The legend sat 0.12 of the axes' height under them and the rows had matplotlib's 5% margins: at 64 ranks, 3
    blank rows above and below them and 5 inches down to the legend."""
    heights = {}
    for n in (8, 64):
        events = [{"name": "F0", "cat": "compute", "ts": float(r), "dur": 100.0, "pid": r, "tid": 0,
                   "args": {"step": 1, "mb": 0}} for r in range(n)]
        with Image.open(draw_timeline(events, tmp_path / f"{n}.png", "t")) as image:
            pixels = np.asarray(image.convert("RGB")).astype(int)
        heights[n] = len(pixels)
        frame = np.where((pixels.sum(-1) < 200).mean(1) > 0.5)[0]  # the rows of the axes' top and bottom edges
        blue = np.where((np.abs(pixels - (0x4C, 0x72, 0xB0)).sum(-1) < 30).any(1))[0]  # F's colour, as in the legend
        bars = blue[(blue > frame.min()) & (blue < frame.max())]
        assert bars.min() - frame.min() < 60 and frame.max() - bars.max() < 110, n  # less than 0.7 of a rank's row
    assert abs(heights[64] - heights[8] - 56 * 0.9 * 110) <= 2  # 56 rows more, nothing else


def test_an_earlier_launchs_summaries_are_not_drawn_under_a_later_layout(run, tmp_path, capsys):
    """A later launch in the run's directory rewrites config.yaml as it starts, and its trace.json and ledger as it
    ends: one that ended before (a signal, a crash) leaves the earlier launch's beside its own layout."""
    later = tmp_path / "run"
    shutil.copytree(run[0], later)
    cfg = load_config(later / "config.yaml", ["parallel.tp=1"])
    (later / "config.yaml").write_text(RUN_CONFIG_HEAD + cfg.to_yaml())
    for name in ("trace.json", "comm_ledger.json"):
        assert main(["trace", str(later)]) == 2
        assert f"{later / name} is an earlier launch's, in pp2 x tp2, sequence-TP, 1f1b; the run's config.yaml is a " \
               f"later launch's, in pp2, 1f1b, which ended before writing its own" in capsys.readouterr().err
        (later / name).unlink()


def test_a_picture_that_cannot_be_drawn_does_not_fail_the_run(tmp_path, capsys):
    """matplotlib's error (or a bug of pictures.py) in one picture: said, the others drawn, the run ends well."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "mesh.png").write_bytes(b"an earlier launch's picture")
    cfg = load_config(TINY, [f"log.run_dir={run_dir}", "train.steps=1", "log.trace=true"])
    too_large = ValueError("Image size of 1300x70000 pixels is too large")
    with mock.patch("sixfold.pictures.draw_mesh", side_effect=too_large):
        assert len(train(cfg)) == 1
    out = capsys.readouterr().out
    assert f"warning: not drawn: mesh.png (ValueError: {too_large}); `sixfold trace {run_dir}` draws the pictures " \
           f"again from the run's files" in out
    assert (run_dir / "timeline.png").stat().st_size > 10_000 and not (run_dir / "mesh.png").exists()
    assert (run_dir / "trace.json").is_file() and (run_dir / "comm_ledger.json").is_file()


def test_writing_a_trace_reads_its_events_a_few_times_whatever_the_ranks(tmp_path):
    """It went over every event once per rank to find the rank's rows: 29 s for 1024 ranks of 200 events, minutes
    at a real run's count, with every other rank waiting."""
    class Events(list):
        passes = 0

        def __iter__(self):
            Events.passes += 1
            return super().__iter__()

    events = Events({"name": "all_gather tp", "cat": "comm", "ts": 10.0 * k + r, "dur": 3.0, "pid": r, "tid": 1,
                     "args": {"step": 1}} for r in range(64) for k in range(4))
    Events.passes = 0
    write_chrome_trace(events, tmp_path / "trace.json", "tp64")
    assert Events.passes <= 4
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert len([e for e in trace if e["ph"] == "M"]) == 64 * 3  # a process and its two rows per rank


def test_a_summary_cut_short_leaves_the_earlier_one_whole(tmp_path):
    """A full disk part-way through comm_ledger.json (or trace.json, a picture): the earlier file stays as it was."""
    path = tmp_path / "comm_ledger.json"
    path.write_text("an earlier run's ledger")

    def half(self, text):
        with open(self, "w") as f:
            f.write(text[:10])
        raise OSError(28, "No space left on device")

    with mock.patch.object(Path, "write_text", autospec=True, side_effect=half), pytest.raises(OSError):
        ledger.write(path, [{}], "dp 2")
    assert path.read_text() == "an earlier run's ledger" and list(tmp_path.iterdir()) == [path]
    (tmp_path / "kept").mkdir()
    path.rename(tmp_path / "kept" / path.name)
    path.symlink_to(tmp_path / "kept" / path.name)  # a link and a mode of the user's: kept
    path.chmod(0o640)
    ledger.write(path, [{}], "dp 2")
    assert path.is_symlink() and json.loads(path.read_text())["layout"] == "dp 2"
    assert path.stat().st_mode & 0o777 == 0o640


def test_trace_command_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["trace", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("model: {dim: 65}\n")  # a run's config.yaml, edited wrongly
    assert main(["trace", str(tmp_path)]) == 2
    assert f"{tmp_path / 'config.yaml'}: model.dim=65 is not divisible by model.n_heads" in capsys.readouterr().err
    for cut, lacks in (("", "model, parallel, train"), ("model: {dim: 64}\nparallel: {tp: 2}\n", "train")):
        (tmp_path / "config.yaml").write_text(cut)  # read as defaults, it would be a single process's
        assert main(["trace", str(tmp_path)]) == 2
        assert f"config.yaml: it has no {lacks}, data, checkpoint, log section(s)" in capsys.readouterr().err


def test_a_malformed_trace_is_refused_naming_the_file(tmp_path, capsys):
    span = {"name": "F0", "cat": "compute", "ph": "X", "ts": 0.0, "dur": 5.0, "pid": 0, "tid": 0,
            "args": {"step": 1, "mb": 0, "stage": 0}}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [{"name": "process_name", "ph": "M", "pid": 0}, span]}))
    assert read_chrome_trace(path) == [span]
    comm = {**span, "cat": "comm", "args": {"step": 1, "async": True}}
    for event, problem in (({"ph": "X"}, "no name"), ({**span, "ts": "a"}, "ts='a', not a number"),
                           ({**span, "args": []}, "args=[], not an object"),
                           ({**span, "args": {"mb": 0}}, "no args.step"), (comm, "no args.group"),
                           ({**span, "args": {"step": 1, "stage": 0}}, "no args.mb"),
                           ({**comm, "args": {**comm["args"], "group": "pp", "ranks": None}},
                            "args.ranks=None, not a list of integers"),
                           ({**comm, "args": {**comm["args"], "group": "pp", "waited_us": "x"}},
                            "args.waited_us='x', not a number")):
        path.write_text(json.dumps({"traceEvents": [span, event]}))
        with pytest.raises(ValueError, match=rf"trace.json is not a trace sixfold wrote \(traceEvents\[1\] has "
                                             rf"{re.escape(problem)}\)"):
            read_chrome_trace(path)
    (tmp_path / "config.yaml").write_text(RUN_CONFIG_HEAD + load_config(None).to_yaml())
    assert main(["trace", str(tmp_path)]) == 2
    assert f"{path} is not a trace sixfold wrote" in capsys.readouterr().err


def test_a_malformed_ledger_is_refused_naming_the_file(tmp_path, capsys):
    book = ledger.Ledger()
    book.record("tp", "all_reduce", 8)
    book.end_step(1)
    good = ledger.write(tmp_path / "comm_ledger.json", [book.summary()], "tp2")
    assert ledger.read(tmp_path) == good
    part = good["ranks"]["0"]
    for data, problem in (({}, "no 'ranks' object"), ([], "no 'ranks' object"),
                          ({"ranks": {"a": part}}, "rank 'a', not a number"),
                          ({"ranks": {"0": {}}}, "rank 0's part has no 'total' traffic"),
                          ({"ranks": {"0": {**part, "phases": {"train": {"tp": {}}}}}},
                           "rank 0's part has no 'phases' object"),
                          ({"ranks": {"0": {**part, "steps": [{"first": 1}]}}}, "rank 0's part has no 'steps' list"),
                          ({"ranks": {"0": {**part, "steps": [{**part["steps"][0], "first": 3, "last": 2}]}}},
                           "rank 0's part has no 'steps' list")):  # (its steps' means would be negative)
        (tmp_path / "comm_ledger.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=re.escape(f"comm_ledger.json is not a ledger sixfold wrote ({problem}")):
            ledger.read(tmp_path)
    (tmp_path / "config.yaml").write_text(RUN_CONFIG_HEAD + load_config(None).to_yaml())
    assert main(["trace", str(tmp_path)]) == 2
    assert f"{tmp_path / 'comm_ledger.json'} is not a ledger sixfold wrote" in capsys.readouterr().err


def test_ledger_steps_match_the_formulas(run):
    """Per rank and training step (docs/guide/tensor-parallel.md, pipeline-parallel.md), with T the tokens of a
    micro-batch, h the width, a = 4 T h the bytes of its hidden state: stage 0 (embedding, block 0) all-gathers
    7a and reduce-scatters 5a per micro-batch over tp, stage 1 (block 1, norm, head, loss) 8a and 5a and
    all-reduces 3 fp32 per token for the loss; once a step tp all-reduces the norm weights' gradients (2 norms
    on stage 0, 3 on stage 1) and the 8-byte squared gradient norm. Each stage sends one [T / tp, h] message
    per micro-batch, and pp sums three 8-byte scalars (the loss with the count of failed ranks, the norm).
    Evaluation is counted apart from the steps."""
    run_dir, output = run
    model, train = load_config(TINY).model, load_config(TINY).train
    tokens, h = train.global_batch // MICRO * train.seq_len, model.dim
    a = 4 * tokens * h
    data = ledger.read(run_dir)
    assert sorted(data["ranks"]) == [str(r) for r in range(PP * TP)]
    for rank, part in data["ranks"].items():
        last = int(rank) // TP == PP - 1
        expected = {
            "tp/all_gather": {"bytes": (8 if last else 7) * a * MICRO},
            "tp/reduce_scatter": {"bytes": 5 * a * MICRO},
            "tp/all_reduce": {"bytes": (12 * tokens * MICRO if last else 0) + 4 * h * (3 if last else 2) + 8},
            "pp/send_recv": {"bytes": MICRO * tokens // TP * h * 4},
            "pp/all_reduce": {"bytes": 24},
        }
        assert [(r["first"], r["last"]) for r in part["steps"]] == [(1, STEPS)], rank  # every step the same
        for step in range(1, STEPS + 1):
            got = ledger.step_traffic(part, step)
            assert {k: {"bytes": t["bytes"]} for k, t in got.items()} == expected, (rank, step)
        assert part["phases"]["eval"]["pp/send_recv"]["calls"] > 0  # the evaluations' forwards, apart
        # each step's stop check, and one after the final save
        assert part["phases"]["other"]["world/all_reduce"]["calls"] == STEPS + 1
        assert part["phases"]["sample"]["pp/send_recv"]["calls"] > 0
        for key, t in part["total"].items():
            assert t["bytes"] == sum(p.get(key, {"bytes": 0})["bytes"] for p in part["phases"].values()), key
    trace = read_chrome_trace(run_dir / "trace.json")
    for rank, part in data["ranks"].items():  # the trace's collectives of a step are the ledger's, byte for byte,
        for step in range(1, STEPS + 1):      # but for the stop check after it (traced with it, "other" there)
            traced = {"world/all_reduce": {"bytes": -32, "calls": -1}}
            for e in trace:
                if e["cat"] == "comm" and e["pid"] == int(rank) and e["args"]["step"] == step:
                    t = traced.setdefault(f"{e['args']['group']}/{e['args']['op']}", {"bytes": 0, "calls": 0})
                    t["bytes"] += e["args"]["bytes"]
                    t["calls"] += 1
            assert traced.pop("world/all_reduce") == {"bytes": 0, "calls": 0}, (rank, step)
            assert traced == ledger.step_traffic(part, step), (rank, step)
    rank0 = ledger.step_traffic(data["ranks"]["0"], 1)
    assert [m["comm_bytes"] for m in read_metrics(run_dir)] == [sum(t["bytes"] for t in rank0.values())] * STEPS
    assert f"communication ledger, 4 rank(s) summed; per step: mean over {STEPS} training step(s); total: this " \
           f"run's, steps 1-{STEPS} and all else (evaluation, setup, checkpoints, the sample)" in output
    assert f"{'tp':<14}{'reduce_scatter':<16}{4 * 5 * a * MICRO:>16,}" in output


def test_overlap_of_asynchronous_collectives():
    """In flight: the union of a group's spans; hidden: the share not spent blocked in its wait()."""
    def comm(rank, start, end, waited, group="fsdp", asynchronous=True):
        args = {"group": group, "waited_us": waited, "step": 1, **({"async": True} if asynchronous else {})}
        return {"pid": rank, "cat": "comm", "name": f"all_reduce {group}", "ts": start, "dur": end - start,
                "args": args}
    events = [comm(0, 0, 4000, 0), comm(0, 2000, 6000, 1500), comm(0, 10000, 12000, 500),
              comm(1, 0, 1000, 1000, "loss"), comm(1, 0, 9000, 9000, "tp", asynchronous=False)]
    assert overlap(events) == {"fsdp": {0: (8.0, 0.75, 0.0)}, "loss": {1: (1.0, 0.0, 0.0)}}
    table = overlap_table(events)
    assert "fsdp" in table and "75% of 8.0 ms" in table and "tp" not in table
    assert overlap_table(events[-1:]).endswith("none traced")


def test_the_guide_shows_the_overlap_tables_heading_as_printed():
    guide = (Path(__file__).resolve().parent.parent / "docs" / "guide" / "observability.md").read_text()
    assert f"```\n{overlap_table([]).splitlines()[0]}\n  fsdp " in guide


def test_overlap_counts_from_the_last_peer():
    """Time blocked before every rank taking part has posted a collective (or both ends a message) is waiting for
    a slower rank: counted apart, not as communication; a message is done when its receive is."""
    def comm(rank, name, start, end, wait_at, waited, op="all_reduce"):
        args = {"group": name.split()[1], "op": op, "async": True, "ranks": [0, 1], "wait_after_us": wait_at - start,
                "waited_us": waited, "step": 1}
        return {"pid": rank, "cat": "comm", "name": name, "ts": start, "dur": end - start, "args": args}
    events = [comm(0, "all_reduce loss unit 0", 0, 10000, 6000, 4000),  # rank 1 posts it at 8000
              comm(1, "all_reduce loss unit 0", 8000, 10000, 9000, 1000),
              comm(0, "send_recv pp RECV_B(s0,m0)", 0, 5000, 1000, 4000, "send_recv"),  # its send is posted at 4000
              comm(1, "send_recv pp SEND_B(s1,m0)", 4000, 5000, 20000, 0, "send_recv")]
    assert overlap(events) == {"loss": {0: (2.0, 0.0, 2.0), 1: (2.0, 0.5, 0.0)},
                               "pp": {0: (1.0, 0.0, 3.0), 1: (1.0, 1.0, 0.0)}}
    assert "25% of 4.0 ms, 2.0 ms waiting for peers" in overlap_table(events)
    # a send waited for at the step's end (30000) is done when its receive is (7000)
    events += [comm(1, "send_recv pp SEND_B(s1,m1)", 6000, 30000, 30000, 0, "send_recv"),
               comm(0, "send_recv pp RECV_B(s0,m1)", 5000, 7000, 6500, 500, "send_recv")]
    assert overlap(events)["pp"] == {0: (2.0, 0.25, 3.0), 1: (2.0, 1.0, 0.0)}  # rank 1: not 25.0 ms
    # a cp ring's hop (no pipeline label) waits for the same hop on its peers
    hops = [comm(0, "send_recv cp ring", 0, 5000, 1000, 4000, "send_recv"),
            comm(1, "send_recv cp ring", 4000, 5000, 4500, 500, "send_recv")]
    assert overlap(hops) == {"cp": {0: (1.0, 0.0, 3.0), 1: (1.0, 0.5, 0.0)}}
    # wait() goes on past the completion (summing a CPU reduce-scatter's slices): compute, not communication
    summed = [comm(r, "reduce_scatter fsdp unit 0", 0, 1000, 900, 600, "reduce_scatter") for r in (0, 1)]
    assert overlap(summed) == {"fsdp": {0: (1.0, 0.9, 0.0), 1: (1.0, 0.9, 0.0)}}


def test_time_blocked_in_other_communication_is_not_hidden():
    """A collective in flight while its rank is blocked in another one (waiting for it while it is in flight, or in
    a synchronous collective) is not hidden behind compute: an HSDP all-reduce across replicas while the next
    unit's reduce-scatter is waited for, a gradient all-reduce during a tensor-parallel all-gather. Waiting for a
    slower rank to post the other one is not counted against it (nor as hidden)."""
    def comm(name, start, end, wait_at=None, waited=0.0, asynchronous=True):
        args = {"group": name.split()[1], "op": name.split()[0], "step": 1, "ranks": [0],
                **({"async": True, "wait_after_us": wait_at - start, "waited_us": waited} if asynchronous else {})}
        return {"pid": 0, "cat": "comm", "name": name, "ts": start, "dur": end - start, "args": args}
    events = [comm("all_reduce dp_replicate unit 3", 0, 4000, 4000, 0),  # done before its wait
              comm("reduce_scatter fsdp unit 2", 1000, 3000, 1000, 2000),  # blocked 1000-3000
              comm("all_gather tp tokens", 3500, 4000, asynchronous=False)]  # blocked 3500-4000
    assert overlap(events) == {"dp_replicate": {0: (4.0, 1 - 2500 / 4000, 0.0)}, "fsdp": {0: (2.0, 0.0, 0.0)}}
    late = [{**e, "args": {**e["args"], "ranks": [0, 1]}} for e in events[:2]]  # rank 1 posts the reduce-scatter
    late += [{**events[1], "pid": 1, "ts": 2000, "dur": 1000, "args": {**events[1]["args"], "ranks": [0, 1],
                                                                        "wait_after_us": 0, "waited_us": 1000}},
             {**events[0], "pid": 1, "ts": 0, "dur": 4000, "args": {**events[0]["args"], "ranks": [0, 1]}}]
    assert overlap(late)["dp_replicate"][0] == (4.0, 1 - 1000 / 4000, 0.0)  # blocked 2000-3000 only
    assert overlap(late)["fsdp"][0] == (1.0, 0.0, 1.0)
    # in a synchronous collective, from when its last rank posted it (rank 1 at 3800)
    checks = [{**events[2], "args": {**events[2]["args"], "ranks": [0, 1]}},
              {**events[2], "pid": 1, "ts": 3800, "dur": 200, "args": {**events[2]["args"], "ranks": [0, 1]}}]
    assert overlap(events[:2] + checks)["dp_replicate"][0] == (4.0, 1 - 2200 / 4000, 0.0)


def test_run_reports_the_pipeline_messages_hidden(run):
    shares = overlap(read_chrome_trace(run[0] / "trace.json"))["pp"]
    assert sorted(shares) == list(range(PP * TP))
    assert all(0 <= s <= 1 and ms > 0 and late >= 0 for ms, s, late in shares.values())
    assert any(late > 0 for _, _, late in shares.values())  # stage 0 waits for stage 1's first backward
    assert "asynchronous communication hidden behind compute" in run[1]


def test_receives_are_posted_a_compute_ahead_on_gloo(run):
    """Each receive is posted before the compute ahead of the one that uses its data starts (the step's first
    ones before its first compute), so its data never waits at the receiver unposted."""
    events = read_chrome_trace(run[0] / "trace.json")
    checked = 0
    for rank in range(PP * TP):
        for step in range(1, STEPS + 1):
            mine = [e for e in events if e["pid"] == rank and e["args"]["step"] == step]
            computes = sorted((e for e in mine if e["cat"] == "compute" and e["name"][0] in "FB"),
                              key=lambda e: e["ts"])
            order = {(e["name"][0], e["args"]["stage"], e["args"]["mb"]): i for i, e in enumerate(computes)}
            for e in mine:
                label = e["name"].split()[-1]
                if e["cat"] == "comm" and label.startswith("RECV_"):
                    stage, micro = (int(x[1:]) for x in label[7:-1].split(","))
                    i = order[label[5], stage, micro]
                    assert e["ts"] < computes[max(i - 1, 0)]["ts"], (rank, step, label)
                    checked += 1
    assert checked == STEPS * (PP - 1) * TP * 2 * MICRO  # each stage boundary: activations and gradients


def test_completion_is_stamped_before_the_wait_on_gloo():
    proc = torchrun("completion.py", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("completion OK") == 2


def test_an_overlap_row_of_many_ranks_names_those_that_hide_the_least():
    def comm(rank, waited):
        args = {"group": "fsdp", "waited_us": waited, "step": 1, "async": True}
        return {"pid": rank, "cat": "comm", "name": "all_reduce fsdp", "ts": 0, "dur": 1000, "args": args}
    row = overlap_table([comm(r, 50 * r) for r in range(20)]).splitlines()[1]  # rank r hides 1 - r / 20
    assert row.endswith("| " + ", ".join(f"r{r} 1.0 ms {1 - r / 20:.0%}" for r in range(12, 20)) +
                        "; the 12 other ranks hide 45% to 100%")
    assert len(overlap_table([comm(r, r) for r in range(1024)]).splitlines()[1]) < 300
    few = overlap_table([comm(r, 0) for r in range(9)]).splitlines()[1]
    assert few.endswith(", ".join(f"r{r} 1.0 ms 100%" for r in range(9)))
