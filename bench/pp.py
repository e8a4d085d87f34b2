"""Pipeline parallel: each schedule's bubble (measured from sixfold's trace, simulated, theory), and sixfold's
pipeline beside torch.distributed.pipelining on the same stages and data.

    python bench/pp.py --runs 5 --micro 8 --pp4 --runs4 2 [--write]

The workload is configs/bench.yaml with uniform stages: 8 blocks of dim 256, a 320-token vocabulary (the
embedding and head cost about a tenth of a block), 8 sequences of 256 tokens per step, one per micro-batch.
Each run is a torchrun job (OMP_NUM_THREADS=1 per rank, bench/common.py); sixfold and torch alternate per
schedule, --runs times at pp=2 and with --pp4 --runs4 times at pp=4. The timed steps (after the warm-up) come
before the last 3, which sixfold's jobs trace.

Bubble: per rank, 1 - (its F, B and W spans) / (the step's makespan: first compute start to last compute end
over all ranks), averaged over the traced steps, then the median over runs. The simulator gets the median F,
B and W span of the same job (B the input gradient: a B that holds its weight gradient too counts only where no
W is traced; the runtime traces an early sender's weight gradient as a W), and once more with the message
latency measured in the trace and the runtime's way of waiting for messages, and its early sends.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

from common import (QUIET, ROOT, WARMUP, Pipe, add_write, leave, machine, paired, pipeline_worker, revision,
                    save_result, sixfold_worker, spread, torchrun, wait_quiet, write_doc)

MODEL = ["model.vocab_size=320", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8"]
# schedule -> (stages per rank, torch's class or None)
SCHEDULES = {"gpipe": (1, "ScheduleGPipe"), "1f1b": (1, "Schedule1F1B"),
             "interleaved": (2, "ScheduleInterleaved1F1B"), "breadth-first": (2, "ScheduleLoopedBFS"),
             "zb-h1": (1, None), "zb-v": (2, "ScheduleZBVZeroBubble")}
TRACED = 3  # steps sixfold's trainer traces (the last ones), after the timed ones
TIMED = 8  # steps timed by default, untraced
COMPUTE = ("F", "B", "W")


def config(args, world: int, run_dir: str):
    from sixfold.config import load_config

    v = SCHEDULES[args.schedule][0]
    return load_config(args.config, MODEL + [
        f"parallel.pp={world}", f"parallel.pp_schedule={args.schedule}", f"parallel.pp_virtual_stages={v}",
        f"train.micro_batches={args.micro}", f"train.global_batch={args.micro}", f"train.steps={args.steps}",
        f"log.run_dir={run_dir}", "log.trace=true", "log.progress=false", "log.tensorboard=false",
        "checkpoint.save_final=false"])


# ---- workers (one torchrun rank each) ----

def sixfold_side(cfg) -> dict:
    import sixfold.train as trainer

    pipes = []

    class Recorded(trainer.Pipeline):  # keeps the runtime, for its own count of micro-batches in flight
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            pipes.append(self)

    trainer.Pipeline = Recorded
    trainer.draw_pictures = lambda *a: []  # no picture: matplotlib would count in the peak memory
    out = {**sixfold_worker(cfg), "peak_in_flight": pipes[0].peak_in_flight}
    trace = Path(cfg.log.run_dir) / "trace.json"
    if trace.exists():  # rank 0: every rank's compute spans (F, B or W, with their stage and micro-batch), its sends
        # (a batch per run) and receives
        out["spans"] = [(e["pid"], e["args"]["step"], e["name"] if e["cat"] == "comm" else e["name"][0], e["ts"],
                         e["dur"], e["args"].get("stage"), e["args"].get("mb"))
                        for e in json.loads(trace.read_text())["traceEvents"]
                        if e.get("cat") == "compute" or e["name"].startswith("send_recv")]
    return out


def torch_side(cfg) -> dict:
    """The same stages (sixfold's Llama cut by split_stages, placed as sixfold places them) run by torch's
    PipelineStage and schedule classes (common.pipeline_worker); loss summed over tokens / the step's tokens,
    as in sixfold."""
    return pipeline_worker(cfg, pieces, SCHEDULES[cfg.parallel.pp_schedule][1])


def pieces(cfg) -> Pipe:
    """This rank's stages of sixfold's Llama, each a module whose forward runs the stage; the last one's ends
    with the head (its logits go to the loss). The head stays in the stage: torch's zero-bubble schedules detach
    a stage's output after its input gradient, so a head in the loss would lose its input before its W."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from sixfold.model.llama import Llama, init_weights
    from sixfold.parallel.pipeline.schedules import placement
    from sixfold.parallel.pipeline.stages import split_stages
    from sixfold.parallel.tensor import cross_entropy

    t, p = cfg.train, cfg.parallel

    class Piece(nn.Module):
        def __init__(self, stage, rows: int):
            super().__init__()
            self.stage, self.llama = stage, Llama(cfg.model, stages=[stage])
            init_weights(self.llama, t.seed)
            self.tokens = self.llama.tokens(rows, t.seq_len, torch.device("cpu"))

        def forward(self, x):
            h = self.llama.run(self.stage, x, self.tokens)
            return self.llama.logits(h, False) if self.stage.head else h

    stages = split_stages(cfg.model, p.pp * p.pp_virtual_stages, t.seq_len)
    where = placement(p.pp, p.pp_virtual_stages, p.pp_schedule)
    mine = [Piece(s, t.global_batch // t.micro_batches) for s in stages if where[s.index] == dist.get_rank()]
    last = next((s.llama for s in mine if s.stage.head), None)

    def loss(logits, labels):  # sixfold's Llama.loss after the head (tp=1: the whole vocabulary)
        return cross_entropy(last.tp, logits, labels.flatten(), 0, cfg.model.vocab_size)

    return Pipe([(s.stage.index, s) for s in mine], len(stages), loss)


def worker(args) -> None:
    # both sides load torch's pipelining (and with it what a fused AdamW loads, ~70 MB of sympy and more)
    # before their memory mark, so that neither counts the libraries
    importlib.import_module("torch.distributed.pipelining")

    world = int(os.environ["WORLD_SIZE"])
    cfg = config(args, world, str(Path(args.out) / "run"))
    save_result(args.out, sixfold_side(cfg) if args.worker == "sixfold" else torch_side(cfg))
    leave(args.worker)


# ---- the bubble, measured and predicted ----

def measured(spans: list, pp: int) -> dict:
    """Per rank idle fraction of each traced step, averaged; the median F, B and W span, over all stages and per
    stage, and the message latency (ms)."""
    comm = [s for s in spans if s[2] not in COMPUTE]
    spans = [s for s in spans if s[2] in COMPUTE]
    idle = [[] for _ in range(pp)]
    for step in sorted({s[1] for s in spans}):
        mine = [s for s in spans if s[1] == step]
        makespan = max(s[3] + s[4] for s in mine) - min(s[3] for s in mine)
        for r in range(pp):
            idle[r].append(1 - sum(s[4] for s in mine if s[0] == r) / makespan)
    ms = {k: statistics.median(s[4] for s in _input_part(spans) if s[2] == k) / 1e3 for k in "FBW"
          if any(s[2] == k for s in spans)}
    stages = range(max(s[5] for s in spans) + 1)
    per_stage = {k: [statistics.median([s[4] for s in _input_part([s for s in spans if s[5] == i]) if s[2] == k]
                                       or [0.0]) / 1e3 for i in stages] for k in ms}
    return {"idle": [statistics.mean(i) for i in idle], "ms": {**ms, "comm": latency(comm, spans)},
            "stage_ms": per_stage}


def _input_part(spans: list) -> list:
    """The spans less the B spans that hold their weight gradient too, where others are traced apart from theirs
    (a B without a W action sends early, and its weight gradient is traced as a W): B the input gradient alone."""
    with_w = {(s[1], s[5], s[6]) for s in spans if s[2] == "W"}
    return [s for s in spans if s[2] != "B" or not with_w or (s[1], s[5], s[6]) in with_w]


def latency(comm: list, compute: list) -> float:
    """The median time from a send's posting to its data being usable on the receiver, over the receives whose
    rank had ended its last compute before the message was sent, so was waiting for it (ms)."""
    sent = {(step, a): ts for _, step, name, ts, *_ in comm for a in name.split()[2:] if a.startswith("SEND")}

    def source(recv: str) -> str:  # RECV_F(s2,m0) comes from SEND_F(s1,m0), RECV_B(s0,m3) from SEND_B(s1,m3)
        kind, s, m = re.fullmatch(r"RECV_([FB])\(s(\d+),m(\d+)\)", recv).groups()
        return f"SEND_{kind}(s{int(s) + (-1 if kind == 'F' else 1)},m{m})"

    waits = []
    for rank, step, name, ts, dur, *_ in comm:
        recv = name.split()[2]
        if recv.startswith("RECV"):
            t_sent, usable = sent[step, source(recv)], ts + dur
            idle_from = max((c[3] + c[4] for c in compute if c[0] == rank and c[3] + c[4] <= usable), default=ts)
            if idle_from <= t_sent:
                waits.append(usable - t_sent)
    return statistics.median(waits) / 1e3 if waits else 0.0


def simulated(name: str, pp: int, m: int, ms: dict, per_stage: dict | None = None):
    """The simulator's run of the schedule with the median costs, messages instant; given per_stage (each kind's
    costs by stage), as run: each stage with its own costs and the messages with the measured latency."""
    from sixfold.parallel.pipeline.schedules import build
    from sixfold.parallel.pipeline.simulate import Costs, simulate

    c = {k: tuple(v) for k, v in per_stage.items()} if per_stage else ms
    costs = Costs(c["F"], c["B"], c.get("W", 0.0), ms["comm"] if per_stage else 0.0)
    return simulate(build(name, pp, SCHEDULES[name][0], m), costs)


def replayed(name: str, pp: int, m: int, spans: list, latency_ms: float) -> list[float]:
    """Per rank, the simulator's idle fraction with every compute action costing its own measured span in each
    traced step (and messages the measured latency), averaged over the steps: what the measured idle would be
    if the runtime spent no time between actions beyond waiting for messages."""
    from sixfold.parallel.pipeline.schedules import Action, build
    from sixfold.parallel.pipeline.simulate import Costs, simulate

    schedule, idle = build(name, pp, SCHEDULES[name][0], m), [[] for _ in range(pp)]
    for step in sorted({s[1] for s in spans if s[2] in COMPUTE}):
        durations = {Action(s[2], s[5], s[6]): s[4] / 1e3 for s in spans if s[1] == step and s[2] in COMPUTE}
        for r, stats in enumerate(simulate(schedule, Costs(comm=latency_ms), durations=durations).ranks):
            idle[r].append(stats.bubble)
    return [statistics.mean(i) for i in idle]


def theory(name: str, p: int, v: int, m: int) -> float:
    """Idle fraction of the makespan by the papers' formulas (F = B = W for the zero-bubble ones)."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name in ("interleaved", "breadth-first"):
        return (p - 1) / v / (m + (p - 1) / v)
    if name == "zb-h1":
        return (p - 1) / (3 * m + p - 1)  # a third of 1F1B's idle time
    return 0.0


def per_rank(values, digits: int = 2) -> str:
    return " / ".join(f"{x:.{digits}f}" for x in values)


def bubble_row(name: str, pp: int, m: int, runs: list[dict]) -> tuple[str, str]:
    """The table row, and for a zero-bubble schedule whose W spans were empty the simulator's bubble had B
    and W been split (each half the measured B)."""
    v = SCHEDULES[name][0]
    stats = [measured(r[0]["spans"], pp) for r in runs]
    idle = [statistics.median(s["idle"][k] for s in stats) for k in range(pp)]
    ms = {k: statistics.median(s["ms"][k] for s in stats) for k in stats[0]["ms"]}
    per_stage = {k: [statistics.median(s["stage_ms"][k][i] for s in stats) for i in range(len(costs))]
                 for k, costs in stats[0]["stage_ms"].items()}
    sim, as_run = simulated(name, pp, m, ms), simulated(name, pp, m, ms, per_stage)
    replay = [statistics.median(x) for x in zip(*(replayed(name, pp, m, r[0]["spans"], s["ms"]["comm"])
                                                  for r, s in zip(runs, stats)))]
    costs = " / ".join(f"{ms[k]:.1f}" if k in ms else "-" for k in ("F", "B", "W", "comm"))
    row = (f"| {name} | {pp} | {v} | {per_rank(idle)} | **{statistics.mean(idle):.3f}** | "
           f"{per_rank([r.bubble for r in sim.ranks])} | **{sim.bubble:.3f}** | "
           f"{per_rank([r.bubble for r in as_run.ranks])} | **{as_run.bubble:.3f}** | {per_rank(replay)} | "
           f"**{statistics.mean(replay):.3f}** | {theory(name, pp, v, m):.3f} | "
           f"{costs} | {per_rank([sum(c) for c in zip(*per_stage.values())], 1)} | "
           f"{per_rank([r.peak_in_flight for r in sim.ranks], 0)} | "
           f"{per_rank([r['peak_in_flight'] for r in runs[0]], 0)} |")
    note = ""
    if "W" in ms and ms["W"] < 0.05 * ms["B"]:
        split = simulated(name, pp, m, {**ms, "B": ms["B"] / 2, "W": ms["B"] / 2})
        note = (f"{name} pp={pp}: W spans of {ms['W']:.2f} ms, so B computed the weight gradients too; with them "
                f"split (B = W = {ms['B'] / 2:.0f} ms) the simulator gives {split.bubble:.3f}.")
    return row, note


# ---- driver ----

def step_time(r: dict) -> float:
    """A rank's mean time of the timed steps: after the warm-up, before the traced ones."""
    return statistics.mean(r["step_s"][WARMUP:len(r["step_s"]) - TRACED])


def job(side: str, name: str, pp: int, args, log: list) -> list[dict]:
    """One torchrun job, on a quiet machine where it can be had: launched again (--tries in all) while other
    processes kept more than QUIET cores busy. Logs (those cores in the job kept, launches thrown away)."""
    for tries in range(1, args.tries + 1):
        wait_quiet(120)
        ranks, others = torchrun(__file__, pp, "--worker", side, "--schedule", name, "--micro", str(args.micro),
                                 "--steps", str(args.steps), "--config", args.config)
        r = ranks[0]
        idle = f", idle {statistics.mean(measured(r['spans'], pp)['idle']):.3f}" if "spans" in r else ""
        again = others > QUIET and tries < args.tries
        print(f"pp={pp} {name:13} {side:7}: {step_time(r):.3f} s/step{idle}, peak "
              f"{max(x['peak_mb'] for x in ranks):.0f} MB, step-1 loss {r['loss'][0]:.6f}, other processes "
              f"{others:.2f} cores{' (run again)' if again else ''}", flush=True)
        if not again:
            log.append((others, tries - 1))
            return ranks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3, help="alternations (sixfold and torch, either first in turn) per "
                   "schedule at pp=2")
    p.add_argument("--micro", type=int, default=8, help="micro-batches per step (one sequence each)")
    p.add_argument("--steps", type=int, default=WARMUP + TIMED + TRACED,
                   help=f"steps per job; the first {WARMUP} and the last {TRACED} (traced) untimed")
    p.add_argument("--tries", type=int, default=3, help="launches of a job while other processes are busy")
    p.add_argument("--pp4", action="store_true", help="also pp=4, the bubble and torch beside it (4 ranks on the "
                   "cores there are)")
    p.add_argument("--runs4", type=int, default=2, help="alternations per schedule at pp=4")
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--config", default=str(ROOT / "configs" / "bench.yaml"))
    add_write(p)
    p.add_argument("--worker", choices=("sixfold", "torch"), help="(internal) run one rank of one side")
    p.add_argument("--schedule", choices=SCHEDULES, help="(internal) the worker's schedule")
    p.add_argument("--out", help="(internal) where a worker writes its result")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.steps <= WARMUP + TRACED:
        p.error(f"--steps must be more than {WARMUP + TRACED}: {WARMUP} warm-up steps, then the timed ones, then "
                f"{TRACED} traced")
    wait_quiet(120)
    rev, load, others, began = revision(), os.getloadavg(), [], time.perf_counter()
    sizes = [(2, args.runs)] + ([(4, args.runs4)] if args.pp4 else [])
    runs = {(name, pp): [] for pp, _ in sizes for name in args.schedules}
    torch_runs = {(name, pp): [] for pp, _ in sizes for name in args.schedules if SCHEDULES[name][1]}
    for pp, alternations in sizes:
        for i in range(alternations):
            for name in args.schedules:
                for side in ("sixfold", "torch")[::1 if i % 2 == 0 else -1]:  # who goes first alternates too
                    if side == "sixfold":
                        runs[name, pp].append(job("sixfold", name, pp, args, others))
                    elif (name, pp) in torch_runs:
                        torch_runs[name, pp].append(job("torch", name, pp, args, others))
    if revision() != rev:
        rev += f", then {revision()} before the last run ended"

    bubble = ["| schedule | pp | v | measured idle per rank | mean | simulated per rank | mean | simulated as run, "
              "per rank | mean | replayed per rank | mean | theory | F / B / W / latency ms | F + B + W per stage ms | "
              "in flight per rank (simulator) | runtime's peak |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [bubble_row(name, pp, args.micro, rs) for (name, pp), rs in runs.items()]
    notes = [note for _, note in rows if note]
    bubble += [row for row, _ in rows] + ([""] + notes if notes else [])
    versus = ["| schedule | pp | sixfold s/step | torch s/step | time ratio | paired | sixfold peak MB | "
              "torch peak MB | memory ratio | step-1 loss sixfold / torch |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for (name, pp), theirs in torch_runs.items():
        ours = runs[name, pp]
        st = [[step_time(r[0]) for r in side] for side in (ours, theirs)]
        mem = [[max(x["peak_mb"] for x in r) for r in side] for side in (ours, theirs)]
        loss = [ours[0][0]["loss"][0], theirs[0][0]["loss"][0]]
        flag = "" if abs(loss[0] - loss[1]) <= 1e-5 * abs(loss[0]) else " **differ**"
        versus.append(f"| {name} | pp={pp} | {spread(st[0], 3)} | {spread(st[1], 3)} | "
                      f"**{statistics.median(st[0]) / statistics.median(st[1]):.3f}** | {paired(*st)} | "
                      f"{spread(mem[0], 0)} | "
                      f"{spread(mem[1], 0)} | **{statistics.median(mem[0]) / statistics.median(mem[1]):.3f}** | "
                      f"{loss[0]:.6f} / {loss[1]:.6f}{flag} |")
    cores, repeats = [o for o, _ in others], sum(n for _, n in others)
    busy = max(cores)
    body = "\n".join([
        f"Command: `python bench/pp.py {' '.join(sys.argv[1:])}`  ", f"Machine: {machine()}  ", f"sixfold: {rev}  ",
        f"Date: {time.strftime('%Y-%m-%d')}; m={args.micro} micro-batches; {args.runs} alternating run(s) per "
        f"schedule at pp=2{f' and {args.runs4} at pp=4' if args.pp4 else ''}, steps {WARMUP + 1}-"
        f"{args.steps - TRACED} timed, the last {TRACED} traced. "
        f"{repeats} job(s) run again because other processes were busy; in the jobs kept they used "
        f"{statistics.median(cores):.2f} cores "
        f"in the median job, {busy:.2f} at most; load average (1 min) "
        f"{load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {(time.perf_counter() - began) / 60:.0f} "
        "minutes in all"
        + (": a shared machine, read the times as rough." if busy > 0.5 else "."),
        "", "### Bubble: idle fraction of the step", "",
        "Per rank (rank 0 / rank 1 / ...) and the mean over ranks. Simulated: sixfold's simulator on the schedule's "
        "lists with the job's median F, B and W spans (B the input gradient; a B with no W action sends it before "
        "computing its weight gradient, which the trace shows as a W span; the first stage's B sends nothing "
        "and holds both), messages instant. As run: each stage with its own median F, B and W spans (next to "
        "last column) and the measured "
        "message latency (median time from a send to its data being usable, over the receives whose rank was "
        "already waiting for them); as in the runtime, each receive is waited for by the compute that uses it. "
        "Replayed: as run, but every action costs its own measured span in each traced step, so the rest of the "
        "measured idle is time the runtime spends between actions (Python, posting messages, the step's own work "
        "around the schedule), not the spans' lengths. Theory: the papers' formulas, in which a B is one block: "
        "(p-1)/(m+p-1) for GPipe and 1F1B, ((p-1)/v)/(m+(p-1)/v) for interleaved and breadth-first, (p-1)/(3m+p-1) "
        "for ZB-H1 (a third of 1F1B's idle time at F = B = W), 0 for ZB-V; sending input gradients early cuts "
        "GPipe's, 1F1B's and interleaved's idle time from (p-1)(F+B+W) to (p-1)(F+B) per stage. In flight: the "
        "most micro-batches whose activations a rank "
        "holds at once."
        + (" pp=4 runs 4 ranks on the 2 cores (OMP_NUM_THREADS=1): spans stretch while more than 2 ranks compute, "
           "so its rows show each schedule's shape more than its cost." if args.pp4 else ""), "", *bubble,
        "", "### sixfold vs torch.distributed.pipelining", "",
        "Times are s/step and memory MB (peak RSS above the mark before the model, max over ranks): median over "
        "runs (range). Paired: the time ratio of each alternation (a sixfold job and the torch job next to it; "
        "sixfold goes first in odd alternations, torch in even ones): median (range).", "", *versus])
    print(body)
    write_doc("pp", "Pipeline bubble: measured, simulated, theory; sixfold vs torch.distributed.pipelining", body,
              args.write)


if __name__ == "__main__":
    main()
