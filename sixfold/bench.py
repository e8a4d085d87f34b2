"""`sixfold bench`: the step time and peak memory of a layout on the common CPU workload (configs/bench.yaml), or
with --table the eight layouts of issue #11 beside picotron, torchtitan and DeepSpeed; --max-seq: maxseq.py.

Each run is its own job (benchjob.py). A run's time is rank 0's mean wall time per step after WARMUP steps.
"""
from __future__ import annotations

import math
import os
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from .benchjob import NO_RESUME, BenchError, launch, quiet
from .config import Config, ConfigError, check_available, differing, load_config, override
from .launch import under_torchrun
from .measure import DOC, QUIET, ROOT, machine, revision, write_doc

BENCH = ROOT / "configs" / "bench.yaml"
WARMUP = 2  # steps left out of the timing
ROWS_PER_RANK = 4  # sequences per data-parallel rank and step, unless train.global_batch is given
PEERS = ("picotron", "torchtitan 0.3.0", "DeepSpeed 0.19.8 ZeRO-3")


@dataclass(frozen=True)
class Layout:
    name: str
    overrides: tuple[str, ...]
    peers: tuple[str, str, str]  # s/step of PEERS on this workload, as measured for issue #11


TABLE = (
    Layout("1 process", (), ("0.351", "0.567", "0.454")),
    Layout("dp 2", ("parallel.dp_replicate=2",), ("0.678", "0.984 (DDP), 1.081 (FSDP)", "0.845")),
    Layout("dp 4", ("parallel.dp_replicate=4",), ("1.398", "2.345 (FSDP)", "1.803")),
    Layout("tp 2", ("parallel.tp=2",), ("0.535", "0.929", "-")),
    Layout("pp 2 (4 micro-batches)", ("parallel.pp=2", "parallel.pp_schedule=1f1b", "train.micro_batches=4"),
           ("0.644 (1F1B)", "0.946 (interleaved)", "-")),
    Layout("cp 2", ("parallel.cp=2",), ("0.868", "1.031", "-")),
    Layout("dp2 x tp2", ("parallel.dp_replicate=2", "parallel.tp=2"), ("0.982", "2.239 (FSDP)", "-")),
    Layout("dp2 x pp2", ("parallel.dp_replicate=2", "parallel.pp=2", "parallel.pp_schedule=1f1b",
                         "train.micro_batches=4"), ("0.821", "1.692 (FSDP)", "-")),
)


def workload_config(path: str | None, overrides: list[str], steps: int) -> Config:
    """CONFIG (default configs/bench.yaml) with the overrides, for `steps` steps; train.global_batch 4 per
    data-parallel rank unless an override sets it."""
    path = path or str(BENCH)
    if steps_set := override(overrides, "train.steps"):
        raise ConfigError(f"{steps_set}: sixfold bench runs --steps N steps (default 10); give --steps instead")
    batch = ROWS_PER_RANK * load_config(path, overrides, check=False).parallel.dp
    try:
        cfg = load_config(path, [f"train.global_batch={batch}", *overrides, f"train.steps={steps}", *NO_RESUME])
    except ConfigError as e:
        if "train.global_batch" not in str(e) or override(overrides, "train.global_batch"):
            raise
        raise ConfigError(f"{e} (sixfold bench set train.global_batch={batch}, {ROWS_PER_RANK} sequences per "
                          f"data-parallel rank, as none was given)") from None
    check_available(cfg)
    return cfg


def time_run(cfg: Config, threads: str | None = None) -> dict:
    """One job of cfg: rank 0's mean step time after warm-up (its steps alone; wall_s: the whole loop from step to
    step, logging and the stop check between steps in), each rank's peak MB (2**20 bytes), the cores other processes
    kept busy meanwhile, and the accelerator."""
    job = launch(cfg, threads)
    if job.oom:
        failed = next(r for r in job.ranks if r["oom"])
        if failed["in_step"]:
            raise BenchError(f"{cfg.parallel.describe()} ran out of memory in a step; lower train.seq_len or "
                             f"train.global_batch (sixfold bench --max-seq finds the longest sequence that fits)")
        raise BenchError(f"{cfg.parallel.describe()}: {failed['error']}")
    first = job.ranks[0]
    return {"step_s": statistics.mean(first["step_s"][WARMUP:]), "wall_s": per_step(first["elapsed_s"]),
            "others": job.others, "peak_mb": [r["peak_bytes"] / 2**20 for r in job.ranks],
            "accelerator": first["accelerator"]}


def per_step(ends: list[float]) -> float:
    """The mean time per step after WARMUP steps, from the times at which each step ended."""
    return (ends[-1] - ends[WARMUP - 1]) / (len(ends) - WARMUP)


def line(name: str, r: dict, steps: int) -> str:
    return (f"{name}: {r['step_s']:.3f} s/step (rank 0, mean of steps {WARMUP + 1}-{steps}), peak MB per rank "
            f"{', '.join(f'{m:.0f}' for m in r['peak_mb'])}; other processes kept {r['others']:.2f} cores busy")


def fastest(peers: tuple[str, ...]) -> float:
    return min(float(v) for cell in peers for v in re.findall(r"\d+\.\d+", cell))


def report(results: list[list[dict]], argv: list[str], rev: str, steps: int) -> str:
    """The --table section of docs/benchmarks.md; results: each layout's jobs."""
    rows = []
    for layout, runs in zip(TABLE, results):
        times = [r["step_s"] for r in runs]
        median, peak = statistics.median(times), statistics.median(max(r["peak_mb"]) for r in runs)
        spread = f" ({min(times):.3f}-{max(times):.3f})" if len(runs) > 1 else ""
        rows.append(f"| {layout.name} | **{median:.3f}**{spread} | {' | '.join(layout.peers)} | "
                    f"{median / fastest(layout.peers):.2f} | {peak:.0f} | {max(r['others'] for r in runs):.2f} |")
    jobs = len(results[0])
    return "\n".join([
        f"Command: `sixfold {' '.join(argv)}`  ", f"Machine: {machine(results[0][0]['accelerator'])}  ",
        f"sixfold: {rev}  ",
        f"Date: {time.strftime('%Y-%m-%d')}; "
        + ("one job per layout" if jobs == 1 else f"{jobs} jobs per layout, one per round over the layouts; the "
           "median (range)")
        + f", OMP_NUM_THREADS = cores / ranks (at least 1); rank 0's mean wall time per step over steps "
        f"{WARMUP + 1}-{steps}. Other processes kept at most "
        f"{max(r['others'] for runs in results for r in runs):.2f} cores busy during a job (last column; a job is "
        f"run again, up to 3 times, while they keep more than {QUIET} busy, and the least disturbed one kept).",
        "",
        "Seconds per step, lower is better. The peers' times are those measured for issue #11 on the same workload "
        "(`configs/bench.yaml`, 4 sequences of 256 tokens per data-parallel rank, fp32, CPU, gloo); \"sixfold / "
        "fastest peer\" below 1 means sixfold is faster. dp is `parallel.dp_replicate`; the pp layouts run 1F1B "
        "with 4 micro-batches. Peak MB: the largest rank's peak memory, median over jobs (CPU: resident-set growth "
        "from just before the model is built, file-backed pages left out; CUDA: max_memory_allocated).",
        "",
        f"| layout | sixfold | {' | '.join(PEERS)} | sixfold / fastest peer | sixfold peak MB | other load (cores) |",
        "|---|---|---|---|---|---|---|---|",
        *rows])


def undisturbed_run(cfg: Config, threads: str, tries: int = 3) -> dict:
    """A job of cfg, as least_disturbed runs one."""
    return least_disturbed(lambda: time_run(cfg, threads), tries)


def least_disturbed(run: Callable[[], dict], tries: int = 3) -> dict:
    """run() again (up to `tries` times in all) while other processes kept more than QUIET cores busy (its result's
    "others"); the least disturbed result kept."""
    runs = []
    while len(runs) < tries and (not runs or runs[-1]["others"] > QUIET):
        runs.append(run())
    return min(runs, key=lambda r: r["others"])


def threads_per_rank(cfg: Config) -> int:
    """The machine's cores shared by the layout's ranks (a single process uses them all, as the peers' did)."""
    return cores_per(cfg.parallel.world_size)


def cores_per(ranks: int) -> int:
    """The machine's cores over `ranks`, at least 1."""
    return max(1, (os.cpu_count() or 1) // ranks)


def table(path: str | None, overrides: list[str], steps: int, write: bool, argv: list[str], runs: int = 1) -> None:
    """The layouts of TABLE, `runs` rounds over all of them (a slow spell of the machine then falls on every
    layout alike), each layout's median job reported."""
    configs = [workload_config(path, [*overrides, *layout.overrides], steps) for layout in TABLE]  # all refused first
    # what the jobs train (no evaluation, checkpoints, sample) in each row's layout, where the token cache lies aside
    changed = []
    for layout, cfg in zip(TABLE, configs):
        mine, workload = (quiet(c).to_dict() for c in (cfg, workload_config(None, list(layout.overrides), steps)))
        for key, ours, theirs in differing(mine, workload, ("model", "train", "data", "parallel")):
            if key != "parallel.timeout_s" and (said := f"{key}={ours} ({BENCH.name}: {theirs})") not in changed:
                changed.append(said)
    if changed:
        raise ConfigError(f"--table sets sixfold beside the peers' times on {BENCH.name}'s workload in their layouts, "
                          f"which this config changes: {', '.join(changed)}; set them back, or time your own config "
                          f"without --table, one layout at a time")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the workload is the CPU's (gloo), as the peers' times are
    rev, results = revision(), [[] for _ in TABLE]
    for _ in range(runs):
        for layout, cfg, done in zip(TABLE, configs, results):
            done.append(undisturbed_run(cfg, str(threads_per_rank(cfg))))
            print(line(layout.name, done[-1], steps), flush=True)
    body = report(results, argv, rev, steps)
    print(body)
    if write:
        write_doc("workload", "The common workload: sixfold beside picotron, torchtitan and DeepSpeed", body)
        print(f"wrote {DOC}")


def _given(args, *flags: str) -> list[str]:
    """Those of `flags` set on the command line."""
    return [f for f in flags if (v := getattr(args, f[2:].replace("-", "_"))) is not None and v is not False]


def bench(args, path: str | None, overrides: list[str], argv: list[str]) -> None:
    """The `sixfold bench` command: its flags checked, then a layout timed, the table, or --max-seq."""
    if under_torchrun():
        raise ConfigError("run sixfold bench outside torchrun: it starts a job of its own for each run")
    if args.runs < 1:
        raise ConfigError(f"--runs {args.runs}: give at least 1")
    if args.max_seq:
        if refused := _given(args, "--table", "--write", "--steps") + ["--runs"] * (args.runs != 1):
            raise ConfigError(f"{', '.join(refused)}: not with --max-seq, whose probes run 2 steps each, once")
        if args.budget_gb is not None and not 0 < args.budget_gb < math.inf:
            raise ConfigError(f"--budget-gb {args.budget_gb}: give a positive, finite number of GB")
        from .maxseq import max_seq
        max_seq(path or str(BENCH), overrides, args.budget_gb, args.min, args.max)
        return
    if _given(args, "--budget-gb", "--min", "--max"):
        raise ConfigError(f"{', '.join(_given(args, '--budget-gb', '--min', '--max'))}: only with --max-seq")
    if args.runs != 1 and not args.table:
        raise ConfigError(f"--runs {args.runs}: rounds over the --table's layouts; add --table")
    if args.write and not args.table:
        raise ConfigError("--write puts the --table into docs/benchmarks.md; add --table")
    steps = 10 if args.steps is None else args.steps
    if steps <= WARMUP:
        raise ConfigError(f"--steps {steps}: the first {WARMUP} steps are not timed; give at least {WARMUP + 1}")
    if args.table:
        table(path, overrides, steps, args.write, argv, args.runs)
        return
    cfg = workload_config(path, overrides, steps)
    from .data import load_data
    from .train import check_inputs
    check_inputs(quiet(cfg), load_data(cfg.data))  # what the job trains, refused here, not by its ranks
    threads = os.environ.get("OMP_NUM_THREADS") or str(threads_per_rank(cfg))
    print(line(cfg.parallel.describe(), time_run(cfg, threads), steps))
