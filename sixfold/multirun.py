"""Many training runs in one torchrun job, which starts its processes once: python -m sixfold.multirun PLAN.json.

The plan holds `timeout_s` and `runs`, a list of {name, config}. Runs of one process go first, spread over
the job's ranks. The others follow in the plan's order (so a run may resume from an earlier run's checkpoint):
a run of N ranks uses the job's first N, its process groups made once per rank set (mesh.Groups), while the
other ranks wait at the job's barrier. Rank 0 appends each run's outcome (name, ok, error, seconds) to
results.jsonl beside the plan as soon as it is known. A run that fails does not stop the job: the groups it
used are dropped (their collectives may be out of step) and the next run goes on. A signal stops the job.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from .config import FRESH_START, Config, config_from_dict
from .data import TokenData, load_data
from .join import join_job, leave_job
from .mesh import Groups, ParallelContext, ParallelDims
from .stop import Stopped
from .train import run

RESULTS = "results.jsonl"  # beside the plan

JOB_TIMEOUT = timedelta(hours=2)  # ranks outside a run wait this long for it at the job's barrier


def _attempt(cfg: Config, ctx: ParallelContext, data: TokenData) -> dict:
    """Train one run in `ctx`; its outcome on this rank."""
    start = time.perf_counter()
    try:
        run(cfg, ctx, data)
        error = ""
    except Stopped:  # a signal ends the job, not the run alone
        raise
    except Exception as e:
        where = "".join(traceback.format_tb(e.__traceback__)[-2:])
        error = f"rank {dist.get_rank()}: {type(e).__name__}: {e}\n{where}"
    return {"ok": not error, "error": error, "seconds": round(time.perf_counter() - start, 2), "ended": time.time()}


def _warm_up(cfg: Config, data: TokenData) -> None:
    """One step of `cfg`, a run of one process, untimed and unprinted: a process's first run pays for lazy imports
    (seconds); no run of the plan should."""
    with tempfile.TemporaryDirectory() as where, contextlib.redirect_stdout(io.StringIO()):
        run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=1),
                                log=dataclasses.replace(cfg.log, run_dir=where),
                                checkpoint=dataclasses.replace(cfg.checkpoint, save_final=False, every=0,
                                                                **FRESH_START)),
            ParallelContext.single(), data)


def _load(runs: list[tuple[str, Config]], rank: int) -> dict[str, TokenData]:
    """Each corpus of the plan, loaded once by this process (by rank 0 first, which writes the token cache)."""
    keys = {repr(cfg.data): cfg.data for _, cfg in runs}
    data = {key: load_data(d) for key, d in keys.items()} if rank == 0 else {}
    dist.barrier()
    if rank:
        with warnings.catch_warnings():  # rank 0 has shown them
            warnings.simplefilter("ignore")
            data = {key: load_data(d) for key, d in keys.items()}
    return data


def _report(results: Path, outcomes: list[tuple[str, dict]]) -> None:
    """Rank 0: append outcomes to results.jsonl, then a line each to the output: a run said done is on disk (a
    SIGTERM between runs ends a rank at once, with what it had not yet written)."""
    if dist.get_rank() == 0:
        with results.open("a") as f:
            f.writelines(json.dumps({"name": name, **outcome}) + "\n" for name, outcome in outcomes)
        for name, outcome in outcomes:
            print(f"{name}: {'ok' if outcome['ok'] else 'FAILED'} in {outcome['seconds']:.1f}s", flush=True)


def _singles(runs: list[tuple[str, Config]], data: dict[str, TokenData]) -> list[tuple[str, dict]]:
    """Runs of one process, rank r taking every world-th from the r-th; every outcome, on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [(name, _attempt(cfg, ParallelContext.single(), data[repr(cfg.data)])) for name, cfg in runs[rank::world]]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return [outcome for part in everyone for outcome in part]


def _shared(name: str, cfg: Config, data: dict[str, TokenData], groups: Groups) -> dict:
    """A run on the job's first ranks; its outcome (the error of the first rank to fail), on every rank."""
    world = dist.get_world_size()
    if cfg.parallel.world_size > world:
        return {"ok": False, "error": f"needs {cfg.parallel.world_size} ranks, the job has {world}", "seconds": 0.0}
    ctx = ParallelContext.inside(ParallelDims.from_config(cfg.parallel), groups)
    outcome = _attempt(cfg, ctx, data[repr(cfg.data)]) if ctx else None
    everyone = [None] * world
    dist.all_gather_object(everyone, outcome)
    members = [o for o in everyone if o is not None]
    failed = sorted((o for o in members if not o["ok"]), key=lambda o: o["ended"])
    return {**members[0], "ok": not failed, "error": failed[0]["error"] if failed else ""}


def write_plan(plan: Path, runs: list[tuple[str, Config]], timeout_s: float) -> None:
    """The plan of `runs` (name, config) written at `plan`, the results of an earlier one beside it removed."""
    plan.write_text(json.dumps({"timeout_s": timeout_s,
                                "runs": [{"name": name, "config": cfg.to_dict()} for name, cfg in runs]}))
    plan.with_name(RESULTS).unlink(missing_ok=True)


def read_results(plan: Path) -> dict[str, dict]:
    """The outcomes reported of the plan's runs, by name (none if the job ended before any)."""
    results = plan.with_name(RESULTS)
    lines = results.read_text().splitlines() if results.is_file() else []
    return {o["name"]: o for o in map(json.loads, lines)}


def run_plan(plan_path: str, rank: int) -> None:
    """Every run of the plan, this process being `rank` of the job (joined already)."""
    plan = json.loads(Path(plan_path).read_text())
    runs = [(r["name"], config_from_dict(r["config"])) for r in plan["runs"]]
    results = Path(plan_path).with_name(RESULTS)
    data = _load(runs, rank)
    singles = [(name, cfg) for name, cfg in runs if cfg.parallel.world_size == 1]
    if singles:
        _warm_up(singles[0][1], data[repr(singles[0][1].data)])
    _report(results, _singles(singles, data))
    groups = Groups(timedelta(seconds=plan["timeout_s"]))
    for name, cfg in runs:
        if cfg.parallel.world_size > 1:
            outcome = _shared(name, cfg, data, groups)
            _report(results, [(name, outcome)])
            if not outcome["ok"]:  # its groups' collectives may be out of step: new ones for the next runs
                groups = Groups(groups.timeout)


def main(plan_path: str) -> None:
    try:
        run_plan(plan_path, join_job(JOB_TIMEOUT)[0])
    except Stopped as e:
        if dist.get_rank() == 0:
            print(f"sixfold multirun: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    leave_job()  # the plan's groups are no longer referenced


if __name__ == "__main__":
    main(sys.argv[1])
