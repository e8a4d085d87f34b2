"""What the benchmarks share: the workers' step, memory marks, the alternating torchrun driver, the docs table.

A benchmark (bench/dp.py, bench/fsdp.py, bench/tp.py) describes itself in a `Bench` and calls
`main(bench, description)`.

Each run is its own torchrun job (OMP_NUM_THREADS=1 per rank); sixfold and the torch side alternate.
A run's time is rank 0's mean step time after the warm-up steps; a layout's time is the median over
its runs. Memory is the peak RSS of a rank above its RSS just before the model is built, file-backed
pages left out (sixfold/measure.py), max over ranks. The table goes into docs/benchmarks.md between the
benchmark's markers.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sixfold.measure import QUIET, busy_jiffies, machine, mark_memory, others_while, peak_mb, revision
from sixfold.measure import write_doc as write_into
from sixfold.join import leave_job

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
WARMUP = 2  # steps left out of the timing
ROWS_PER_RANK = 4
TRIES = 4  # launches of a run disturbed by other processes before its last result is kept anyway
# the CPU benchmarks' ranks: one thread each, and no GPU even where there is one (sixfold would take it, torch's
# side runs gloo on the CPU)
CPU_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


@dataclass(frozen=True)
class Bench:
    name: str  # also the docs markers: <!-- name:begin --> ... <!-- name:end -->
    script: str  # the benchmark's file, run by torchrun as each worker
    title: str  # the docs section's heading, written with the markers if they are missing
    side: str  # the torch side's name on the command line and in results
    label: str  # the torch side's name in printed text and in the table
    layout: Callable[[int], list[str]]  # sixfold's parallel overrides for a world size
    describe: Callable[[int], str]  # the table's layout column for a world size
    worker: Callable  # the torch side's worker: cfg -> result dict
    global_batch: Callable[[int], int] = lambda world: ROWS_PER_RANK * world  # sequences per step for a world size
    ranks: tuple[int, ...] = (2, 4)  # the world sizes measured by default


def overrides(bench: Bench, world: int, steps: int, run_dir: str) -> list[str]:
    return [f"train.global_batch={bench.global_batch(world)}", *bench.layout(world),
            f"train.steps={steps}", f"log.run_dir={run_dir}", "log.progress=false",
            "log.tensorboard=false", "checkpoint.save_final=false"]


# ---- workers (one torchrun rank each) ----

def sixfold_worker(cfg) -> dict:
    import sixfold.train as trainer
    from sixfold.model.llama import Llama

    base = {}

    def build(*args):  # the trainer's own Llama, with the memory mark taken just before it
        base["kb"] = mark_memory()
        return Llama(*args)

    trainer.Llama = build
    peak, write = {}, trainer.Trainer._write_outputs

    def written(self, log):  # the training's peak, before rank 0 gathers and writes the run's summaries (torch's
        peak["mb"] = peak_mb(base["kb"])  # side writes none)
        write(self, log)

    trainer.Trainer._write_outputs = written
    history = trainer.train(cfg)
    return {"step_s": [m["step_s"] for m in history], "loss": [m["loss"] for m in history],
            "peak_mb": peak.get("mb", peak_mb(base["kb"]))}


def adamw(t, named):
    """AdamW as sixfold's: torch's fused kernel, no weight decay on the norm weights."""
    import torch

    from sixfold.model.llama import no_decay

    groups = [{"params": [p for n, p in named if not no_decay(n)], "weight_decay": t.weight_decay},
              {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)


def batch_group(data_parallel):
    """The process group whose ranks split the batch: True: every rank; False: none (each reads it whole);
    else a function returning the group (called after the process group is up)."""
    import torch.distributed as dist

    if data_parallel is True:
        return dist.group.WORLD
    return data_parallel() if data_parallel else None


def warm(mesh=None) -> None:
    """A first collective on the world group and on each of `mesh`'s (a DeviceMesh built now), before the side's
    memory mark: sixfold's side has its process groups built and used before its own mark."""
    import torch.distributed as dist

    dist.barrier()
    for name in (mesh.mesh_dim_names or [None]) if mesh is not None else []:
        dist.barrier(group=mesh.get_group(name))


def torch_worker(cfg, wrap, grads_to_none: bool, build=None, data_parallel=True,
                 loss_context=contextlib.nullcontext, mesh=None) -> dict:
    """sixfold's step written with torch's own parts. build(cfg) returns the model (default: sixfold's
    single-process Llama with init_weights); wrap(model, world) returns the module to call and the factor on
    the loss that turns the wrapper's gradient reduction into a sum, as in sixfold. data_parallel: which
    ranks split the batch (batch_group); without it every rank reads the whole batch and computes the whole
    loss. Forward, loss and backward run inside loss_context(). mesh(cfg): the DeviceMesh build uses (cached),
    made and used before the memory mark (warm)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from sixfold.data import BatchLoader, load_data
    from sixfold.model.llama import Llama, init_weights
    from sixfold.parallel.tensor import IGNORE_INDEX
    from sixfold.optim import learning_rate

    t = cfg.train
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    data = load_data(cfg.data)
    warm(mesh(cfg) if mesh else None)
    base = mark_memory()
    torch.manual_seed(t.seed)
    if build is None:
        model = Llama(cfg.model)
        init_weights(model, t.seed)
    else:
        model = build(cfg)
    module, loss_scale = wrap(model, world)
    optim = adamw(t, list(model.named_parameters()))
    group = batch_group(data_parallel)
    batch_ranks = (dist.get_rank(group), dist.get_world_size(group)) if group else (0, 1)
    loader = BatchLoader(data.train, t.seq_len, t.global_batch, t.seed, *batch_ranks, data.shift)
    out = {"step_s": [], "loss": []}
    for step in range(t.steps):
        start = time.perf_counter()
        x, y, _ = loader.batch(step)
        counts = torch.tensor([float((y != IGNORE_INDEX).sum())], dtype=torch.float64)
        if group:
            dist.all_reduce(counts, group=group)
        with loss_context():
            logits = module(x)
            loss_sum = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                                       reduction="sum")
            loss = loss_sum / float(counts)
            (loss * loss_scale).backward()
        total = torch.tensor([float(loss.detach())], dtype=torch.float64)
        if group:
            dist.all_reduce(total, group=group)
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        for g in optim.param_groups:
            g["lr"] = learning_rate(t, step)
        optim.step()
        optim.zero_grad(set_to_none=grads_to_none)
        out["step_s"].append(time.perf_counter() - start)
        out["loss"].append(float(total))
    out["peak_mb"] = peak_mb(base)
    return out


@dataclass
class Pipe:
    """What pipeline_worker runs on one rank: its stages and how they meet the other ranks."""
    modules: list  # (stage index, module) of each stage this rank holds
    stages: int  # stages in all
    loss: Callable  # (the last stage's output, labels) -> the summed token loss
    pp_group: object = None  # the group the stages send over (None: every rank)
    dp_group: object = None  # the ranks that split the batch (None: each reads it whole)


def pipeline_worker(cfg, build: Callable, schedule: str, loss_context=contextlib.nullcontext, mesh=None) -> dict:
    """sixfold's pipelined step run by torch.distributed.pipelining: build(cfg) returns this rank's Pipe, which
    torch's PipelineStage and `schedule` class (its name in torch.distributed.pipelining) run over
    train.micro_batches micro-batches (micro-batch i: the same rows as sixfold's). The loss is the summed token
    loss over the step's tokens, the gradients unscaled (scale_grads=False); the gradient norm is the whole
    model's; schedule.step runs inside loss_context(); mesh as torch_worker's."""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    from torch.distributed.tensor import DTensor

    from sixfold.data import BatchLoader, load_data
    from sixfold.optim import learning_rate
    from sixfold.parallel.tensor import IGNORE_INDEX

    t = cfg.train
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_data(cfg.data)
    warm(mesh(cfg) if mesh else None)
    base = mark_memory()
    torch.manual_seed(t.seed)
    pipe = build(cfg)
    stages = [pipelining.PipelineStage(m, i, pipe.stages, torch.device("cpu"), group=pipe.pp_group)
              for i, m in pipe.modules]
    first = any(i == 0 for i, _ in pipe.modules)
    last = any(i == pipe.stages - 1 for i, _ in pipe.modules)
    step_tokens = [0.0]

    def loss_fn(h, labels):
        return pipe.loss(h, labels) / step_tokens[0]

    runner = getattr(pipelining, schedule)(stages if len(stages) > 1 else stages[0], t.micro_batches,
                                           loss_fn=loss_fn, scale_grads=False)
    named = [(n, q) for _, m in pipe.modules for n, q in m.named_parameters()]
    params = [q for _, q in named]
    optim = adamw(t, named)
    dp = (dist.get_rank(pipe.dp_group), dist.get_world_size(pipe.dp_group)) if pipe.dp_group else (0, 1)
    loader = BatchLoader(data.train, t.seq_len, t.global_batch, t.seed, *dp, data.shift)
    # pp is the outermost dimension, the data-parallel one next: the first rank of a stage's ranks adds the stage's
    # squared gradient norm, the first of each data-parallel rank's replicas (its tp ranks) adds its losses
    per_stage = world // cfg.parallel.pp
    leader, replicas = rank % per_stage == 0, per_stage // dp[1]
    out = {"step_s": [], "loss": []}
    for step in range(t.steps):
        start = time.perf_counter()
        micro = loader.micro_batches(step, t.micro_batches)
        x, y = (torch.cat([m[k] for m in micro]) for k in (0, 1))
        counts = torch.tensor([float((y != IGNORE_INDEX).sum())], dtype=torch.float64)
        if pipe.dp_group:
            dist.all_reduce(counts, group=pipe.dp_group)
        step_tokens[0] = float(counts)
        losses = []
        with loss_context():
            runner.step(*([x] if first else []), target=y if last else None, losses=losses)
        norm = torch.nn.utils.get_total_norm([q.grad for q in params if q.grad is not None])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # over the stage's ranks
        total = torch.tensor([float(norm) ** 2 if leader else 0.0,
                              sum(float(v.detach()) for v in losses) if rank % replicas == 0 else 0.0],
                             dtype=torch.float64)
        dist.all_reduce(total)
        torch.nn.utils.clip_grads_with_norm_(params, t.grad_clip, total[0].sqrt())
        for g in optim.param_groups:
            g["lr"] = learning_rate(t, step)
        optim.step()
        optim.zero_grad()
        out["step_s"].append(time.perf_counter() - start)
        out["loss"].append(float(total[1]))
    out["peak_mb"] = peak_mb(base)
    return out


def worker(bench: Bench, args) -> None:
    from sixfold.config import load_config

    world = int(os.environ["WORLD_SIZE"])
    cfg = load_config(args.config, overrides(bench, world, args.steps, str(Path(args.out) / "run")))
    save_result(args.out, sixfold_worker(cfg) if args.worker == "sixfold" else bench.worker(cfg))
    leave(args.worker)


def leave(side: str) -> None:
    """End a worker's process. sixfold frees all its process groups (leave_job); torch's DeviceMesh and FSDP keep
    some of theirs in caches of their own, whose gloo threads can abort the process while the interpreter exits
    (seen once in 6 FSDP2 jobs): that side exits without finalizing, its result saved."""
    leave_job()
    if side != "sixfold":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def save_result(out: str, result: dict) -> None:
    """A worker's result, one file per rank, for torchrun() to collect."""
    (Path(out) / f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(result))


# ---- driver ----

def other_load(seconds: float = 1.0) -> float:
    """Cores kept busy by other processes over a short sample."""
    before = busy_jiffies()
    time.sleep(seconds)
    return (busy_jiffies() - before) / 100 / seconds


def wait_quiet(limit_s: float = 600) -> None:
    """Start a run only when other processes use less than QUIET cores (gives up after limit_s)."""
    waited = 0
    while other_load() > QUIET and waited < limit_s:
        time.sleep(9)
        waited += 10
    if waited >= limit_s:
        print(f"machine still busy after {limit_s:.0f} s; running anyway", flush=True)


def torchrun(script: str, world: int, *args: str) -> tuple[list[dict], float]:
    """One torchrun job of `script ARGS --out DIR` on `world` ranks (OMP_NUM_THREADS=1 each): every rank's
    result, saved by its worker with save_result, and the cores other processes kept busy meanwhile (a sign
    of a shared, noisy machine)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               f"--log-dir={out}/torchrun", str(script), *args, "--out", out]
        proc, others = others_while(lambda: subprocess.run(cmd, env=CPU_ENV, text=True, capture_output=True))
        if proc.returncode:
            sys.exit(f"{Path(script).name} {' '.join(args)} on {world} ranks failed:\n"
                     f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)], others


def launch(bench: Bench, side: str, world: int, args) -> dict:
    """One torchrun job: rank 0's mean step time after warm-up, max peak memory over ranks, and the
    cores other processes kept busy meanwhile."""
    wait_quiet()
    ranks, others = torchrun(bench.script, world, "--worker", side, "--steps", str(args.steps), "--config",
                             args.config)
    first = ranks[0]
    return {"step_s": statistics.mean(first["step_s"][WARMUP:]), "peak_mb": max(r["peak_mb"] for r in ranks),
            "loss": first["loss"], "others": others}


def measure(bench: Bench, side: str, world: int, args) -> dict:
    """A run on a quiet machine: launched again while other processes used more than QUIET cores."""
    for tries in range(1, TRIES + 1):
        r = launch(bench, side, world, args)
        if r["others"] <= QUIET:
            break
        verdict = f"kept (still disturbed after {TRIES} tries)" if tries == TRIES else "discarded"
        print(f"{world} ranks, {side}: {r['step_s']:.3f} s/step {verdict}, other processes used "
              f"{r['others']:.2f} cores", flush=True)
    return {**r, "repeats": tries - 1}


def spread(values: list[float], digits: int) -> str:
    """Median, with the range over runs."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def paired(ours: list[float], theirs: list[float]) -> str:
    """Each alternation's own ratio (its two runs minutes apart, so a slow spell of the machine falls on both):
    median (range). Every one below 1 is a win that the spread of either side's times alone may hide."""
    return spread([a / b for a, b in zip(ours, theirs)], 3)


def report(bench: Bench, rows: list[dict], args, rev: str) -> str:
    sides, label = ("sixfold", bench.side), bench.label
    kept = [r for row in rows for side in sides for r in row[side]]
    others, repeats = max(r["others"] for r in kept), sum(r["repeats"] for r in kept)
    lines = [f"Command: `python bench/{Path(bench.script).name} {' '.join(sys.argv[1:])}`  ",
             f"Machine: {machine()}  ",
             f"sixfold: {rev}  ",
             f"Date: {time.strftime('%Y-%m-%d')}; {args.runs} alternating run(s) per layout, steps {WARMUP + 1}-"
             f"{args.steps} timed; {repeats} run(s) repeated because other processes were busy; in the runs kept "
             f"they used at most {others:.2f} cores.",
             "",
             "Times are s/step and memory MB: median over runs (range). Paired: the time ratio of each alternation "
             "(a sixfold run and the other side's run next to it; sixfold goes first in odd alternations, the other "
             "side in even ones): median (range).",
             "",
             f"| layout | sixfold s/step | {label} s/step | time ratio | paired | sixfold peak MB | {label} peak MB "
             "| memory ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        t = {side: [r["step_s"] for r in row[side]] for side in sides}
        m = {side: [r["peak_mb"] for r in row[side]] for side in sides}
        time_ratio = statistics.median(t["sixfold"]) / statistics.median(t[bench.side])
        mem_ratio = statistics.median(m["sixfold"]) / statistics.median(m[bench.side])
        lines.append(f"| {bench.describe(row['world'])} ({row['world']} ranks) | {spread(t['sixfold'], 3)} | "
                     f"{spread(t[bench.side], 3)} | **{time_ratio:.3f}** | {paired(t['sixfold'], t[bench.side])} | "
                     f"{spread(m['sixfold'], 0)} | "
                     f"{spread(m[bench.side], 0)} | **{mem_ratio:.3f}** |")
    return "\n".join(lines)


def add_write(parser) -> None:
    parser.add_argument("--write", action="store_true", help="put the table into docs/benchmarks.md (without it: "
                        "printed only)")


def write_doc(name: str, title: str, body: str, write: bool) -> None:
    """With `write` (--write), the table of `name` into this checkout's docs/benchmarks.md."""
    if write:
        write_into(name, title, body, DOC)
        print(f"wrote {DOC.relative_to(ROOT)}")
    else:
        print(f"not written into {DOC.relative_to(ROOT)}: add --write")


def check(bench: Bench, args) -> None:
    """Refuse, before any job, what a job would fail on (ConfigError, naming the flag): sixfold's config at each
    --ranks as its workers load it, and the corpus (its token cache built here, before any timed job)."""
    from sixfold.config import ConfigError, load_config
    from sixfold.data import load_data

    for flag, values in (("--runs", [args.runs]), ("--ranks", args.ranks)):
        if (least := min(values)) < 1:
            raise ConfigError(f"{flag} {least}: give at least 1")
    cfg = load_config(args.config)
    for world in args.ranks:
        try:
            load_config(args.config, overrides(bench, world, args.steps, str(ROOT / "runs" / bench.name)))
        except ConfigError as e:
            raise ConfigError(f"--ranks {world}: {e}") from None
    load_data(cfg.data)


def drive(bench: Bench, args) -> None:
    rev = revision()
    rows = []
    for world in args.ranks:
        row = {"world": world, "sixfold": [], bench.side: []}
        for i in range(args.runs):
            for side in ("sixfold", bench.side)[::1 if i % 2 == 0 else -1]:  # who goes first alternates too
                r = measure(bench, side, world, args)
                row[side].append(r)
                print(f"{world} ranks, run {i + 1}, {side:7}: {r['step_s']:.3f} s/step, peak {r['peak_mb']:.0f} MB, "
                      f"loss at step {args.steps} {r['loss'][-1]:.6f}, other load {r['others']:.2f} cores", flush=True)
        ours, theirs = row["sixfold"][0]["loss"], row[bench.side][0]["loss"]
        gap = max(abs(a - b) for a, b in zip(ours, theirs))
        print(f"{world} ranks: step-1 loss sixfold {ours[0]:.6f}, {bench.label} {theirs[0]:.6f}; largest loss "
              f"difference {gap:.2e}", flush=True)
        if abs(ours[0] - theirs[0]) > 1e-5 * abs(ours[0]):
            print(f"WARNING: {world} ranks: the step-1 losses differ by more than 1e-5 relative: the two sides "
                  "do not compute the same thing", flush=True)
        rows.append(row)
    if revision() != rev:
        rev += f", then {revision()} before the last run ended"
    body = report(bench, rows, args, rev)
    print(body)
    write_doc(bench.name, bench.title, body, args.write)


def main(bench: Bench, description: str) -> None:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--ranks", type=int, nargs="+", default=list(bench.ranks), help="numbers of ranks to measure")
    p.add_argument("--runs", type=int, default=3, help=f"alternations (sixfold and {bench.label}, either first in "
                   "turn) per size")
    p.add_argument("--steps", type=int, default=10, help=f"steps per run; the first {WARMUP} are not timed")
    p.add_argument("--config", default=str(ROOT / "configs" / "bench.yaml"))
    add_write(p)
    p.add_argument("--worker", choices=("sixfold", bench.side), help="(internal) run one rank of one side")
    p.add_argument("--out", help="(internal) where a worker writes its result")
    args = p.parse_args()
    if args.steps <= WARMUP:
        p.error(f"--steps must be more than the {WARMUP} warm-up steps")
    if args.worker:
        worker(bench, args)
        return
    from sixfold.config import ConfigError
    try:
        check(bench, args)
    except ConfigError as e:
        p.error(str(e))
    drive(bench, args)
