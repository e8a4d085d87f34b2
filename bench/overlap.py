"""Communication hidden behind compute, read from sixfold's own trace: per layout and process group, the share of
the asynchronous collectives' time in flight that their ranks did not spend blocked in wait(), with the time
spent waiting for slower ranks apart (sixfold.trace.overlap).

    python bench/overlap.py --runs 3 [--write]

Each run is `sixfold train` with `log.trace=true` (the last 3 steps traced), OMP_NUM_THREADS=1 per rank: the data-
and ZeRO-parallel layouts on the common workload (configs/bench.yaml, 4 sequences of 256 tokens per data-parallel
rank), and the README demo (configs/demo.yaml, 8 ranks) for fewer steps.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import CPU_ENV, ROOT, add_write, spread, wait_quiet, write_doc
from sixfold.measure import machine, revision

BENCH, DEMO = "configs/bench.yaml", "configs/demo.yaml"
LAYOUTS = {  # name -> (config, overrides, ranks)
    "dp_replicate=2 (DDP)": (BENCH, ["parallel.dp_replicate=2", "train.global_batch=8"], 2),
    "dp_shard=2, zero=1": (BENCH, ["parallel.dp_shard=2", "parallel.zero=1", "train.global_batch=8"], 2),
    "dp_shard=2, zero=2": (BENCH, ["parallel.dp_shard=2", "parallel.zero=2", "train.global_batch=8"], 2),
    "dp_shard=2, zero=3": (BENCH, ["parallel.dp_shard=2", "parallel.zero=3", "train.global_batch=8"], 2),
    "dp_replicate=2 x dp_shard=2, zero=3 (HSDP)": (BENCH, ["parallel.dp_replicate=2", "parallel.dp_shard=2",
                                                           "parallel.zero=3", "train.global_batch=16"], 4),
    "pp=2 (1F1B, 4 micro-batches) x dp_shard=2, zero=1": (BENCH, ["parallel.pp=2", "parallel.dp_shard=2",
                                                                  "parallel.zero=1", "train.micro_batches=4",
                                                                  "train.global_batch=8"], 4),
    "demo: pp=2 x dp_shard=2 x tp=2, zero=3": (DEMO, ["log.sample_tokens=0"], 8),
}
TRACED = 3


def run(config: str, overrides: list[str], ranks: int, steps: int) -> dict:
    """One traced training run: per group, the per-rank (ms in flight, share hidden, ms waiting for peers) of its
    traced steps."""
    from sixfold.trace import overlap, read_chrome_trace

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "sixfold.cli", "train", str(ROOT / config), *overrides, f"train.steps={steps}",
               "log.trace=true", "log.progress=false", "log.tensorboard=false", "checkpoint.save_final=false",
               f"log.run_dir={out}/run", "--nproc", str(ranks)]
        proc = subprocess.run(cmd, env=CPU_ENV, text=True, capture_output=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return overlap(read_chrome_trace(Path(out) / "run" / "trace.json"))


def summarize(runs: list[dict], group: str) -> tuple[list[float], list[float], list[float]]:
    """Per run that has the group: ms in flight per rank and traced step, the share hidden (weighted by the ranks'
    ms), and ms waiting for peers per rank and traced step."""
    flight, hidden, late = [], [], []
    for r in runs:
        ranks = r.get(group)
        if not ranks:
            continue
        total = sum(ms for ms, _, _ in ranks.values())
        flight.append(total / len(ranks) / TRACED)
        hidden.append(sum(ms * s for ms, s, _ in ranks.values()) / total if total else 1.0)
        late.append(sum(p for _, _, p in ranks.values()) / len(ranks) / TRACED)
    return flight, hidden, late


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per layout")
    p.add_argument("--steps", type=int, default=8, help=f"steps per run on the workload (the last {TRACED} traced)")
    p.add_argument("--demo-steps", type=int, default=30, help="steps per run of the demo")
    p.add_argument("--only", nargs="+", choices=list(LAYOUTS), help="some of the layouts")
    add_write(p)
    args = p.parse_args()
    rev, began = revision(), time.perf_counter()
    lines = ["| layout | ranks | group | in flight, ms per rank and step | hidden | waiting for peers, ms per rank and "
             "step |", "|---|---|---|---|---|---|"]
    for name in args.only or LAYOUTS:
        config, overrides, ranks = LAYOUTS[name]
        runs = []
        for i in range(args.runs):
            wait_quiet(120)
            runs.append(run(config, overrides, ranks, args.demo_steps if config == DEMO else args.steps))
            print(f"{name}, run {i + 1}: " + "; ".join(
                f"{g} {statistics.median(s for _, s, _ in r.values()):.0%}" for g, r in runs[-1].items()), flush=True)
        for group in sorted({g for r in runs for g in r}):
            flight, hidden, late = summarize(runs, group)
            lines.append(f"| {name} | {ranks} | {group} | {spread(flight, 1)} | **{statistics.median(hidden):.0%}** "
                         f"({min(hidden):.0%}-{max(hidden):.0%}) | {spread(late, 1)} |")
    body = "\n".join([
        f"Command: `python bench/overlap.py {' '.join(sys.argv[1:])}`  ", f"Machine: {machine()}  ",
        f"sixfold: {rev}  ",
        f"Date: {time.strftime('%Y-%m-%d')}; {args.runs} run(s) per layout, the last {TRACED} steps of each traced; "
        f"{(time.perf_counter() - began) / 60:.0f} min in all. Median over runs (range).", "", *lines])
    print(body)
    write_doc("overlap", "Communication hidden behind compute", body, args.write)


if __name__ == "__main__":
    main()
