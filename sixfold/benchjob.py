"""One job of `sixfold bench`: a config trained for its steps by fresh processes, one per rank, each reporting
its step times and peak memory, or that it ran out of memory (CUDA's, or an allocation that failed on CPU).

    python -m sixfold.benchjob DIR    (DIR holds config.yaml; rank r writes rank{r}.json there)

Peak memory: on CUDA torch.cuda.max_memory_allocated; on CPU the peak resident set (VmHWM) above the resident
set just before the model is built (the corpus already loaded), file-backed pages left out (measure.py).
"""
from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from .config import FRESH_START, Config, ConfigError, load_config
from .errors import OutOfMemory, out_of_memory
from .launch import run_ranks
from .measure import mark_memory, others_while, peak_mb

NO_RESUME = tuple(f"checkpoint.{k}=" for k in FRESH_START)  # a job starts afresh: checked as such (a BPE it trains)
OOM_EXIT = 3  # a rank out of memory exits with it, so that torchrun stops the ranks waiting for it
QUIET = {"log": {"progress": False, "tensorboard": False, "trace": False, "sample_tokens": 0},
         "checkpoint": {"every": 0, "save_final": False, **FRESH_START}, "train": {"eval_every": 0}}


class BenchError(RuntimeError):
    """A bench job failed for another reason than running out of memory."""


@dataclass
class Job:
    ranks: list[dict]  # each rank's result: oom, accelerator, device_bytes; if oom, in_step and error (what to
    # change); else step_s, elapsed_s, peak_bytes
    others: float  # cores other processes kept busy while the job ran

    @property
    def oom(self) -> bool:
        return any(r["oom"] for r in self.ranks)


def quiet(cfg: Config) -> Config:
    """cfg as a job trains it: QUIET's settings (no checkpoint, evaluation or sample) over its own."""
    out = copy.deepcopy(cfg)
    for section, values in QUIET.items():
        for key, value in values.items():
            setattr(getattr(out, section), key, value)
    return out


def launch(cfg: Config, threads: str | None = None) -> Job:
    """Train quiet(cfg) in a job of its world size."""
    with tempfile.TemporaryDirectory(prefix="sixfold-bench-") as job:
        settings = quiet(cfg).to_dict()
        settings["log"]["run_dir"] = str(Path(job) / "run")
        (Path(job) / "config.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
        world = cfg.parallel.world_size
        proc, others = others_while(lambda: run_ranks(world, "sixfold.benchjob", [job], threads))
        found = [Path(job) / f"rank{r}.json" for r in range(world)]
        ranks = [json.loads(f.read_text()) for f in found if f.exists()]
        if not any(r["oom"] for r in ranks) and (proc.returncode or len(ranks) < world):
            raise BenchError(f"the job of {cfg.parallel.describe()} at train.seq_len={cfg.train.seq_len} failed "
                             f"(exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return Job(ranks, others)


def memory_ran_out(e: BaseException) -> bool:
    """Whether `e` is an allocation that failed: torch's (CUDA's) or the CPU allocator's, anywhere (the optimizer's
    state, the model's build), or what the trainer raised for one (its OutOfMemory in a step; its ConfigError for
    the model's build, the allocation's error its context)."""
    return isinstance(e, OutOfMemory) or any(out_of_memory(x) for x in (e, e.__context__) if x is not None)


def outside(e: BaseException, ctx) -> str:
    """What to change when allocation `e` failed outside a step, where the model and its optimizer state are made
    (their size does not change with the batch)."""
    said = (str(e) or type(e).__name__).splitlines()[0]
    return (f"rank {ctx.rank} ran out of memory outside a step, where the model and its optimizer state are made "
            f"({said}): choose smaller model.* settings or shard them over more ranks (parallel.zero=3, tp, pp); "
            f"`sixfold plan` estimates a layout's memory")


def main(job: str) -> None:
    import torch

    from .data import load_data
    from .mesh import ParallelContext
    from .train import run

    cfg = load_config(Path(job) / "config.yaml")
    ctx = ParallelContext.initialize(cfg.parallel)
    data = load_data(cfg.data)
    cuda = ctx.device.type == "cuda"
    base = 0 if cuda else mark_memory()
    out = {"accelerator": f"{torch.cuda.get_device_name(ctx.device)}, nccl" if cuda else "gloo",
           "device_bytes": torch.cuda.mem_get_info(ctx.device)[1] if cuda else 0}
    save = Path(job) / f"rank{ctx.rank}.json"
    try:
        history = run(cfg, ctx, data)
    except (MemoryError, RuntimeError, ConfigError) as e:
        if not memory_ran_out(e):
            raise
        save.write_text(json.dumps({**out, "oom": True, "in_step": isinstance(e, OutOfMemory),
                                    "error": str(e) if isinstance(e, (OutOfMemory, ConfigError)) else outside(e, ctx)}))
        os._exit(OOM_EXIT)
    peak = torch.cuda.max_memory_allocated(ctx.device) if cuda else peak_mb(base) * 2**20
    save.write_text(json.dumps({**out, "oom": False, "step_s": [m["step_s"] for m in history],
                                "elapsed_s": [m["elapsed_s"] for m in history], "peak_bytes": int(peak)}))
    ctx.close()


if __name__ == "__main__":
    main(sys.argv[1])
