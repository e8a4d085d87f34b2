"""Expert parallelism: MoE step time with ep = 1, 2, 4 at the same global batch, and the ep all-to-alls' share.

    python bench/ep.py --ep 1 2 4 --runs 2 --steps 8 [--write]

The benchmark model (configs/bench.yaml: 6 layers, 4 sequences of 256 tokens a step) with 8 experts, top-2, on
every layer. ep=N is sixfold's trainer on dp_shard=N ranks, a torchrun job with one thread per rank and
log.trace=true; the layouts alternate within each run. Wall step times are rank 0's (its metrics) after the
warm-up steps, pooled over runs; CPU s/step is each rank's process CPU time in the same steps, which other
processes on a shared machine change far less than the wall time. From the trace (the last 3 steps, every
rank) a rank's share is the summed duration of its "all_to_all ep ..." spans over its step (first event's start
to last event's end), averaged over the traced steps of all runs. Bytes are rank 0's payload per training step from
comm_ledger.json (its whole send buffer, rows it keeps included).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from common import ROOT, WARMUP, add_write, machine, revision, save_result, torchrun, write_doc

MOE = ["model.moe_experts=8", "model.moe_top_k=2"]
LOAD = 1.5  # 1-minute load average to wait for before measuring
MIB = 2 ** 20


def wait_load(limit_s: float = 600) -> None:
    """Wait up to limit_s for the 1-minute load average to fall below LOAD."""
    end = time.time() + limit_s
    while os.getloadavg()[0] >= LOAD and time.time() < end:
        time.sleep(10)


def shares(events: list[dict]) -> list[tuple[int, float, float]]:
    """Per (rank, step): the rank, the step's share in ep all-to-alls and in the expert counts exchange alone."""
    start, end = defaultdict(lambda: float("inf")), defaultdict(float)
    a2a, counts = defaultdict(float), defaultdict(float)
    for e in events:
        key = e["pid"], e["args"]["step"]
        start[key], end[key] = min(start[key], e["ts"]), max(end[key], e["ts"] + e["dur"])
        if e["cat"] == "comm" and e["name"].startswith("all_to_all ep"):
            a2a[key] += e["dur"]
            counts[key] += e["dur"] * e["name"].endswith("expert counts")
    return [(k[0], a2a[k] / (end[k] - start[k]), counts[k] / (end[k] - start[k])) for k in start]


def worker(args) -> None:
    """One rank: the trainer with each step's CPU time recorded; rank 0 adds the trace shares and the ledger."""
    import sixfold.train as trainer
    from sixfold import ledger
    from sixfold.config import load_config

    ep, run_dir, cpu = int(os.environ["WORLD_SIZE"]), Path(args.out) / "run", []
    step = trainer.Trainer.train_step

    def timed(self):
        start = time.process_time()
        metrics = step(self)
        cpu.append(time.process_time() - start)
        return metrics

    trainer.Trainer.train_step = timed
    cfg = load_config(args.config, [*MOE, f"parallel.dp_shard={ep}", f"parallel.ep={ep}", f"train.steps={args.steps}",
                                    "log.trace=true", f"log.run_dir={run_dir}", "log.progress=false",
                                    "log.tensorboard=false", "checkpoint.save_final=false"])
    history = trainer.train(cfg)
    result = {"step_s": [m["step_s"] for m in history[WARMUP:]], "cpu_s": cpu[WARMUP:]}
    if os.environ["RANK"] == "0":
        events = [e for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
        per_step = ledger.mean_per_step(ledger.read(run_dir)["ranks"]["0"])
        result |= {"shares": shares(events), "ep_bytes": per_step.get("ep/all_to_all", {"bytes": 0})["bytes"],
                   "all_bytes": sum(v["bytes"] for v in per_step.values())}
    save_result(args.out, result)


def row(ep: int, runs: list[tuple[list[dict], float]], base: float) -> str:
    steps = [s for ranks, _ in runs for s in ranks[0]["step_s"]]
    cpu = [statistics.mean(s for ranks, _ in runs for s in ranks[r]["cpu_s"]) for r in range(ep)]
    rows = [s for ranks, _ in runs for s in ranks[0]["shares"]]
    a2a = ", ".join(f"{100 * statistics.mean(s[1] for s in rows if s[0] == r):.0f}%" for r in range(ep))
    counts = ", ".join(f"{100 * statistics.mean(s[2] for s in rows if s[0] == r):.1f}%" for r in range(ep))
    mib = [statistics.mean(ranks[0][k] for ranks, _ in runs) / MIB for k in ("ep_bytes", "all_bytes")]
    return (f"| ep={ep}, dp_shard={ep} | {statistics.mean(steps):.3f} | {statistics.median(steps):.3f} "
            f"({min(steps):.3f}-{max(steps):.3f}) | {statistics.median(steps) / base:.2f} | {max(cpu):.3f} | "
            f"{sum(cpu):.3f} | {a2a} | {counts} | {mib[0]:.1f} | {mib[1]:.1f} | "
            f"{statistics.mean(others for _, others in runs):.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4], help="ep sizes (the first is the baseline)")
    p.add_argument("--runs", type=int, default=2, help="jobs per layout")
    p.add_argument("--steps", type=int, default=8, help=f"steps per job; the first {WARMUP} are not timed")
    p.add_argument("--config", default=str(ROOT / "configs" / "bench.yaml"))
    add_write(p)
    p.add_argument("--worker", action="store_true", help="(internal) run one rank")
    p.add_argument("--out", help="(internal) where a worker writes its result")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    rev, began, load0 = revision(), time.time(), os.getloadavg()[0]
    wait_load()
    waited, load1 = time.time() - began, os.getloadavg()[0]
    results = defaultdict(list)
    for i in range(args.runs):
        for ep in args.ep:
            ranks, others = torchrun(__file__, ep, "--worker", "--steps", str(args.steps), "--config", args.config)
            results[ep].append((ranks, others))
            print(f"run {i + 1}, ep={ep}: {statistics.median(ranks[0]['step_s']):.3f} s/step, other processes "
                  f"{others:.2f} cores, load {os.getloadavg()[0]:.2f}", flush=True)
    base = statistics.median(s for ranks, _ in results[args.ep[0]] for s in ranks[0]["step_s"])
    body = "\n".join([
        f"Command: `python bench/ep.py {' '.join(sys.argv[1:])}`  ", f"Machine: {machine()}  ", f"sixfold: {rev}  ",
        f"Date: {time.strftime('%Y-%m-%d')}; {args.runs} job(s) per layout, steps {WARMUP + 1}-{args.steps} timed, "
        f"the last 3 traced. Load average (1 min): {load0:.2f} at the start, {load1:.2f} after waiting "
        f"{waited:.0f} s for it to fall below {LOAD}, {os.getloadavg()[0]:.2f} at the end.", "",
        "| layout | mean s/step | median s/step (range) | median vs first | CPU s/step, busiest rank | CPU s/step, "
        "all ranks | ep all-to-all share of the step, per rank | of which the counts exchange | ep all-to-all "
        "MiB/step (rank 0) | all comm MiB/step (rank 0) | cores other processes used |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(row(ep, results[ep], base) for ep in args.ep)])
    write_doc("ep", "Expert parallel: MoE step time and all-to-all share", body, args.write)
    print(body)


if __name__ == "__main__":
    main()
