"""Pipeline: sending a B's input gradient before computing its weight gradient (the runtime's default for a B
with no W of its own, Schedule.sends_early) against computing both before sending, in the same job.

    python bench/pp_early.py --write

Each layout is one torchrun job of sixfold's trainer on configs/bench.yaml (1F1B, OMP_NUM_THREADS=1 per rank)
whose steps alternate between the two ways after --warmup steps of each; a step is timed on rank 0 between two
barriers, and a way's time is the median of its steps. Alternating step by step leaves the machine's slow
spells on both sides. The simulator's prediction beside it uses the job's own median F, B (input gradient) and
W spans, from the first timed step with early sends, traced.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import ROOT, add_write, save_result, torchrun, write_doc
from sixfold.config import load_config
from sixfold.measure import machine, revision

LAYOUTS = {  # name -> overrides of configs/bench.yaml
    "pp=2, m=4": ["parallel.pp=2", "train.micro_batches=4"],
    "pp=2, m=8": ["parallel.pp=2", "train.micro_batches=8", "train.global_batch=8"],
    "pp=4, m=8, 8 blocks": ["parallel.pp=4", "train.micro_batches=8", "train.global_batch=8", "model.n_layers=8"],
    "pp=2 x tp=2, m=4": ["parallel.pp=2", "parallel.tp=2", "train.micro_batches=4"],
    "pp=2 x tp=2 x dp_shard=2, ZeRO-3, m=4": ["parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=2",
                                              "parallel.zero=3", "train.micro_batches=4", "train.global_batch=8"],
}


def worker(args) -> None:
    import torch.distributed as dist

    from sixfold.mesh import ParallelContext
    from sixfold.train import Trainer

    cfg = load_config(args.config, [*LAYOUTS[args.layout], "log.run_dir=/tmp/sixfold_pp_early"])
    ctx = ParallelContext.initialize(cfg.parallel)
    trainer = Trainer(cfg, ctx)
    pipe, tracer = trainer.pipeline, trainer.comm.tracer
    early, wg = pipe.early, trainer.model.tp.weight_grads
    times, spans = {True: [], False: []}, []
    for i in range(2 * (args.warmup + args.steps)):
        on = i % 2 == 0
        pipe.early = early if on else set()
        wg.used = bool(pipe.split or pipe.early)
        traced = on and i // 2 == args.warmup  # the first timed step with early sends
        tracer.enabled, tracer.events = traced, []
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        dist.barrier()
        if i // 2 >= args.warmup:
            times[on].append(time.perf_counter() - start)
        if traced:
            spans = [(e["name"][0], e["args"]["stage"], e["dur"]) for e in tracer.events
                     if e["cat"] == "compute" and "stage" in e["args"]]
    gathered = [None] * dist.get_world_size() if ctx.rank == 0 else None
    dist.gather_object(spans, gathered, dst=0)
    if ctx.rank == 0:
        save_result(args.out, {"early": statistics.median(times[True]), "after": statistics.median(times[False]),
                               "spans": [s for part in gathered for s in part]})
    else:
        save_result(args.out, {})
    ctx.close()


def predicted(config: str, layout: str, spans: list) -> float:
    """The simulator's step time with early sends over without, from the traced spans' medians (ms)."""
    from sixfold.parallel.pipeline.schedules import build
    from sixfold.parallel.pipeline.simulate import Costs, simulate

    cfg = load_config(config, LAYOUTS[layout])
    median = {k: statistics.median(d for kind, _, d in spans if kind == k) for k in "FW"}
    b_input = statistics.median(d for kind, stage, d in spans if kind == "B" and stage > 0)  # the early senders'
    costs = Costs(median["F"], b_input, median["W"])
    s = build("1f1b", cfg.parallel.pp, 1, cfg.train.micro_batches)
    return simulate(s, costs).makespan / simulate(s, costs, early=False).makespan


def report(rows: list[tuple[str, dict, float]], args) -> str:
    lines = [f"Command: `python bench/pp_early.py {' '.join(sys.argv[1:])}`  ", f"Machine: {machine()}  ",
             f"sixfold: {revision()}  ", f"Date: {time.strftime('%Y-%m-%d')}; configs/bench.yaml, 1F1B, one job per "
             f"layout alternating the two ways step by step, {args.steps} timed steps of each after {args.warmup} "
             "of each; OMP_NUM_THREADS=1 per rank (more than 2 ranks time-share the 2 cores).", "",
             "| layout | early sends s/step | sends after the weight gradient s/step | time ratio | simulated ratio |",
             "|---|---|---|---|---|"]
    for layout, r, sim in rows:
        lines.append(f"| {layout} | {r['early']:.3f} | {r['after']:.3f} | **{r['early'] / r['after']:.3f}** | "
                     f"{sim:.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--steps", type=int, default=20, help="timed steps of each way")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each way first")
    p.add_argument("--config", default=str(ROOT / "configs" / "bench.yaml"))
    add_write(p)
    p.add_argument("--worker", action="store_true", help="(internal)")
    p.add_argument("--layout", help="(internal)")
    p.add_argument("--out", help="(internal)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for layout in args.layouts:
        world = load_config(args.config, LAYOUTS[layout]).parallel.world_size
        ranks, _ = torchrun(__file__, world, "--worker", "--layout", layout, "--steps", str(args.steps),
                            "--warmup", str(args.warmup), "--config", args.config)
        rows.append((layout, ranks[0], predicted(args.config, layout, ranks[0]["spans"])))
        print(rows[-1][0], f"{rows[-1][1]['early'] / rows[-1][1]['after']:.3f}", flush=True)
    body = report(rows, args)
    print(body)
    write_doc("pp-early", "Pipeline: input gradients sent before weight gradients", body, args.write)


if __name__ == "__main__":
    main()
