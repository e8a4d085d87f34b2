"""Issue #11's common workload in torchtitan 0.3.0 and in sixfold, alternating on this machine: the peers' times in
`sixfold bench --table` are fixed numbers from a machine the issue does not name; this puts one peer beside sixfold.

    python3 -m venv /tmp/titan && /tmp/titan/bin/pip install torch==2.13.0 torchtitan==0.3.0 triton   # once
    python bench/vs_torchtitan.py --python /tmp/titan/bin/python --runs 3 --write

torchtitan trains its debugmodel (the workload's model: dim 256, 6 layers, 16 heads, vocab 2048) on sixfold's
corpus of configs/bench.yaml (as JSON lines its Hugging Face loader reads), tokenized by a BPE of 2,048 tokens
trained here on the same text, 4 sequences of 256 tokens per data-parallel rank, fp32, through
bench/torchtitan_cpu.py (what it sets and bends to run on a CPU is listed there). A run's time is rank 0's mean
wall time per step over steps 3-10, the loop's own work between steps (logging, sixfold's stop check) in: for
torchtitan from the times its log stamps on each step's line, for sixfold from the elapsed time its trainer
records at each step's end (`sixfold bench`'s jobs; its own table times the steps alone). Without --python (or
TORCHTITAN_PYTHON) it says so and exits with SKIPPED.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import spread  # noqa: E402
from sixfold.bench import (TABLE, WARMUP, least_disturbed, threads_per_rank, undisturbed_run,  # noqa: E402
                           workload_config)
from sixfold.measure import DOC, machine, others_while, revision, write_doc  # noqa: E402

SKIPPED = 3  # the exit status without a torchtitan Python (bench/run_all.py reports the section as skipped)
SHIM = Path(__file__).resolve().parent / "torchtitan_cpu.py"
BASE = ("--module", "llama3", "--config", "llama3_bench", "--training.seq_len", "256", "--training.local_batch_size",
        "4", "--parallelism.spmd_backend", "partial_dtensor", "--training.disable_cuda_graphs")
REPLICATE, FSDP = "--parallelism.data_parallel_replicate_degree", "--parallelism.data_parallel_shard_degree"
PP = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1")
ZERO_BUBBLE = ("--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble")
# torchtitan's ways of running each row of sixfold's TABLE (as issue #11 measured it): (name, ranks, arguments).
# Its replication is fully_shard over a replicate x 1 mesh (HSDP, shards of 1), which issue #11 calls DDP; its
# pipeline runs its debugmodel's schedule (interleaved 1F1B, 2 stages a rank) and its fastest here of the others
TITAN = {
    "1 process": [("", 1, ())],
    "dp 2": [("replicated", 2, (REPLICATE, "2", FSDP, "1")), ("FSDP", 2, (FSDP, "2"))],
    "dp 4": [("replicated", 4, (REPLICATE, "4", FSDP, "1")), ("FSDP", 4, (FSDP, "4"))],
    "tp 2": [("", 2, ("--parallelism.tensor_parallel_degree", "2"))],
    "pp 2 (4 micro-batches)": [("interleaved", 2, PP), ("interleaved zero bubble", 2, (*PP, *ZERO_BUBBLE))],
    "dp2 x tp2": [("FSDP", 4, (FSDP, "2", "--parallelism.tensor_parallel_degree", "2"))],
    "dp2 x pp2": [("FSDP, interleaved", 4, (FSDP, "2", *PP)),
                  ("FSDP, interleaved zero bubble", 4, (FSDP, "2", *PP, *ZERO_BUBBLE))],
}


def other_ways(layout) -> list[tuple[str, tuple[str, ...]]]:
    """sixfold's other ways of a row of TABLE beside the table's own: ZeRO-1 for data parallelism (the optimizer
    sharded, as torchtitan's FSDP shards it), the zero-bubble schedule ZB-H1 for pipelining (the table's is 1F1B)."""
    ways = []
    if layout.name.startswith("dp"):
        ways.append(("ZeRO-1", (*(o.replace("dp_replicate", "dp_shard") for o in layout.overrides), "parallel.zero=1")))
    if "parallel.pp_schedule=1f1b" in layout.overrides:
        ways.append(("ZB-H1", tuple(o.replace("=1f1b", "=zb-h1") for o in layout.overrides)))
    return ways


NOT_RUN = {"cp 2": "torchtitan's context parallelism runs SDPA through DTensor, which has no rule for the CPU's flash "
                   "kernel, and flex attention, its other way, has no CPU backward"}
STEP = re.compile(r"^\[titan\] (\S+ \S+) .*?step:\s+(\d+)\s", re.M)


def assets(out: Path) -> None:
    """The workload's corpus as JSON lines, and a tokenizer.json of 2,048 tokens trained on it, in `out`."""
    from sixfold.corpus import iter_documents
    from sixfold.data import BPETokenizer

    docs = [text for _, text, *_ in iter_documents(workload_config(None, [], 10).data)]
    (out / "data").mkdir()
    (out / "data" / "data.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tok = BPETokenizer.train(docs, 2047)._tok  # and a start token: 2,048
    tok.add_special_tokens(["<|begin_of_text|>"])
    (out / "tokenizer").mkdir()
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    (out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>", "add_bos_token": True,
         "add_eos_token": True}))


def titan_run(python: str, work: Path, ranks: int, args: tuple[str, ...], steps: int) -> dict:
    """One torchtitan job: rank 0's mean step time after warm-up, from its log, each rank's peak MB (as
    torchtitan_cpu.py measures it), and the cores other processes kept busy meanwhile."""
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "--local-ranks-filter", "0", str(SHIM), *BASE, "--hf_assets_path", str(work / "tokenizer"),
           "--dataloader.dataset_path", str(work / "data"), "--training.steps", str(steps),
           "--dump_folder", str(work / "out"), *args]
    with tempfile.TemporaryDirectory(dir=work) as peaks:
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)),
               "CUDA_VISIBLE_DEVICES": "", "SIXFOLD_PEAK_DIR": peaks}
        proc, others = others_while(lambda: subprocess.run(cmd, cwd=work, env=env, text=True, capture_output=True))
        found = [Path(peaks) / f"rank{r}.json" for r in range(ranks)]
        peak_mb = [json.loads(f.read_text())["peak_mb"] for f in found if f.exists()]
    log = proc.stdout + proc.stderr
    step_s = step_time(log, steps)
    if proc.returncode or step_s is None or len(peak_mb) < ranks:
        sys.exit(f"torchtitan {' '.join(args)} on {ranks} ranks failed:\n{log[-4000:]}")
    return {"step_s": step_s, "peak_mb": peak_mb, "others": others}


def step_time(log: str, steps: int) -> float | None:
    """The mean time per step after warm-up, from the stamps of the log's step lines (None: not all there)."""
    stamps = {int(n): datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f") for t, n in STEP.findall(log)}
    if not {WARMUP, steps} <= stamps.keys():
        return None
    return (stamps[steps] - stamps[WARMUP]).total_seconds() / (steps - WARMUP)


def median(runs: list[dict]) -> float:
    return statistics.median(r["step_s"] for r in runs)


def peak(runs: list[dict]) -> float:
    """The median over runs of the largest rank's peak MB."""
    return statistics.median(max(r["peak_mb"]) for r in runs)


def cell(row: dict, side: str, value) -> str:
    return ", ".join(f"{value(runs)}{f' ({way})' if way else ''}" for (s, way), runs in row.items() if s == side)


def report(rows: dict, args, rev: str, titan_version: str) -> str:
    others = max(r["others"] for row in rows.values() for runs in row.values() for r in runs)
    lines = [f"Command: `python bench/vs_torchtitan.py {' '.join(sys.argv[1:])}`  ",
             f"Machine: {machine()}  ",
             f"sixfold: {rev}; torchtitan {titan_version}  ",
             f"Date: {time.strftime('%Y-%m-%d')}; {args.runs} round(s) over the layouts, each way of each layout "
             f"run once a round, sixfold's and torchtitan's in turn (who goes first alternates); steps "
             f"{WARMUP + 1}-{args.steps} timed; other processes kept at most {others:.2f} cores busy in the runs "
             f"kept.",
             "",
             "Seconds per step, median over runs (range); lower is better. A way not named is `sixfold bench "
             "--table`'s (dp_replicate, 1F1B) or torchtitan's only one. Where a side has several ways of a row, "
             "\"sixfold / torchtitan\" divides the fastest of sixfold's by the fastest of torchtitan's; paired: each "
             "round's run of the one over the other's, median (range). Peak MB: the largest rank's resident-set "
             "growth, from just before the model is built (sixfold: its corpus loaded; torchtitan: its Trainer "
             "begun, so its data loader, built after, counts), median over runs; its ratio is of the ways the "
             "time ratio compares. The last column is torchtitan as issue #11 gives it.",
             "",
             "| layout | sixfold | torchtitan here | sixfold / torchtitan | paired | sixfold peak MB | torchtitan peak "
             "MB | memory ratio | torchtitan, issue #11 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for layout in TABLE:
        if layout.name in NOT_RUN:
            lines.append(f"| {layout.name} | - | not run: {NOT_RUN[layout.name]} | - | - | - | - | - | "
                         f"{layout.peers[1]} |")
            continue
        if layout.name not in rows:
            continue
        row = rows[layout.name]
        ours, theirs = (min((k for k in row if k[0] == side), key=lambda k: median(row[k]))
                        for side in ("sixfold", "torchtitan"))
        pairs = [a["step_s"] / b["step_s"] for a, b in zip(row[ours], row[theirs])]
        times, mbs = (lambda runs: spread([r["step_s"] for r in runs], 3)), (lambda runs: f"{peak(runs):.0f}")
        lines.append(f"| {layout.name} | {cell(row, 'sixfold', times)} | {cell(row, 'torchtitan', times)} | "
                     f"**{median(row[ours]) / median(row[theirs]):.2f}** | {spread(pairs, 2)} | "
                     f"{cell(row, 'sixfold', mbs)} | {cell(row, 'torchtitan', mbs)} | "
                     f"{peak(row[ours]) / peak(row[theirs]):.2f} | {layout.peers[1]} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--python", default=os.environ.get("TORCHTITAN_PYTHON"),
                   help="a Python with torchtitan 0.3.0, torch 2.13 and triton (default: $TORCHTITAN_PYTHON)")
    p.add_argument("--runs", type=int, default=3, help="rounds over the layouts")
    p.add_argument("--steps", type=int, default=10, help=f"steps per run; the first {WARMUP} are not timed")
    p.add_argument("--only", nargs="+", choices=[x.name for x in TABLE if x.name not in NOT_RUN], metavar="LAYOUT",
                   help="these rows only (the table's names: '1 process', 'dp 2', ...)")
    p.add_argument("--write", action="store_true", help="put the table into docs/benchmarks.md")
    args = p.parse_args()
    if not args.python:
        print("skipped: give --python (or set TORCHTITAN_PYTHON) to a Python with torchtitan 0.3.0; see "
              "bench/vs_torchtitan.py's docstring for the one line that installs it")
        sys.exit(SKIPPED)
    found = subprocess.run([args.python, "-c", "import importlib.metadata as m; print(m.version('torchtitan'))"],
                           text=True, capture_output=True)
    if found.returncode:
        sys.exit(f"{args.python} cannot import torchtitan: {found.stderr.strip()[-300:]}")
    if args.steps <= WARMUP:
        p.error(f"--steps must be more than the {WARMUP} warm-up steps")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    layouts = [x for x in TABLE if x.name not in NOT_RUN and (not args.only or x.name in args.only)]
    ways = {x.name: [("sixfold", "", workload_config(None, list(x.overrides), args.steps))]
            + [("sixfold", way, workload_config(None, list(o), args.steps)) for way, o in other_ways(x)]
            + [("torchtitan", way, (ranks, a)) for way, ranks, a in TITAN[x.name]] for x in layouts}
    rev, rows = revision(), {name: {(side, way): [] for side, way, _ in ws} for name, ws in ways.items()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assets(work)
        for i in range(args.runs):
            for x in layouts:
                for side, way, how in ways[x.name][::1 if i % 2 == 0 else -1]:
                    if side == "sixfold":  # timed as torchtitan is: step to step
                        r = undisturbed_run(how, str(threads_per_rank(how)))
                        r = {**r, "step_s": r["wall_s"]}
                    else:
                        r = least_disturbed(lambda: titan_run(args.python, work, *how, args.steps))
                    rows[x.name][side, way].append(r)
                    print(f"round {i + 1}, {x.name}, {side} {way}: {r['step_s']:.3f} s/step, other processes "
                          f"{r['others']:.2f} cores", flush=True)
    body = report(rows, args, rev, found.stdout.strip())
    print(body)
    if args.write:
        write_doc("torchtitan", "The common workload: sixfold beside torchtitan, both run here", body)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
