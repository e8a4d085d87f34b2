"""The parity contract: a layout reproduces the single-process run of the same global batch.

Metrics (fp32):
- losses: relative difference |layout - reference| / |reference| at every step, at most LOSS_RTOL;
- weights: per parameter, RMS(layout - reference) / RMS(reference) after the last step, at most WEIGHT_RTOL.
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import Checkpoint
from .config import Config, ParallelConfig
from .launch import run_torchrun
from .logs import read_metrics
from .slices import Reader
from .train import train

LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-5
QUIET = {"log": {"progress": False, "tensorboard": False, "sample_tokens": 0, "trace": False},
         "checkpoint": {"every": 0, "save_final": True, "resume": ""}}


@dataclass
class ParityResult:
    layout: str
    steps: int
    loss_rel: float
    weight_rel: float
    worst_param: str

    @property
    def ok(self) -> bool:
        return self.loss_rel <= LOSS_RTOL and self.weight_rel <= WEIGHT_RTOL

    def line(self) -> str:
        return (f"parity {'OK' if self.ok else 'FAILED'}: {self.layout}, {self.steps} steps, "
                f"max loss rel diff {self.loss_rel:.2e} (tol {LOSS_RTOL:.0e}), max weight rms-rel diff "
                f"{self.weight_rel:.2e} (tol {WEIGHT_RTOL:.0e}, worst {self.worst_param})")


def _with(cfg: Config, run_dir: Path, steps: int, **sections) -> Config:
    out = Config(**{k: dataclasses.replace(getattr(cfg, k)) for k in ("model", "parallel", "train", "data",
                                                                     "checkpoint", "log")})
    for section, values in {**QUIET, **sections}.items():
        for k, v in values.items():
            setattr(getattr(out, section), k, v)
    out.train.steps = steps
    out.log.run_dir = str(run_dir)
    return out


def reference_config(cfg: Config, run_dir: Path, steps: int) -> Config:
    """Same model, data and global batch in one process and one micro-batch; an MoE model keeps its micro-
    batches, over which its load-balancing statistics are taken."""
    micro = cfg.train.micro_batches if cfg.model.moe_experts else 1
    ref = _with(cfg, run_dir, steps, train={"micro_batches": micro})
    ref.parallel = ParallelConfig(timeout_s=cfg.parallel.timeout_s)
    return ref


def compare(layout_dir: Path, reference_dir: Path, layout: str) -> ParityResult:
    a, b = read_metrics(layout_dir), read_metrics(reference_dir)
    if len(a) != len(b):
        raise RuntimeError(f"layout ran {len(a)} steps, reference {len(b)}")
    loss_rel = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b))
    wa = Reader(Checkpoint(layout_dir), "model").all()
    wb = Reader(Checkpoint(reference_dir), "model").all()
    worst, weight_rel = "", 0.0
    for name, ref in wb.items():
        diff = (wa[name].double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()
        if float(diff) >= weight_rel:
            worst, weight_rel = name, float(diff)
    if math.isnan(loss_rel):
        loss_rel = math.inf
    return ParityResult(layout, len(a), loss_rel, weight_rel, worst)


def check(cfg: Config, steps: int, workdir: str | None = None, references: dict | None = None) -> ParityResult:
    """Run the layout under torchrun and the reference in this process; compare the two. `references` maps a
    reference run's config to its directory: runs of the same reference are made once."""
    root = Path(workdir or tempfile.mkdtemp(prefix="sixfold-check-"))
    layout_cfg = _with(cfg, root / "layout", steps)
    root.mkdir(parents=True, exist_ok=True)
    (root / "layout.yaml").write_text(layout_cfg.to_yaml())
    if cfg.parallel.world_size > 1:
        proc = run_torchrun(cfg.parallel.world_size, ["train", str(root / "layout.yaml")], capture=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the layout run failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}"
                               f"\n{proc.stderr[-4000:]}")
    else:
        train(layout_cfg)
    ref = reference_config(cfg, root / "reference", steps)
    key = repr(dataclasses.replace(ref, log=dataclasses.replace(ref.log, run_dir="")))  # wherever it is written
    ref_dir = root / "reference"
    if references is not None and key in references:
        ref_dir = references[key]
    else:
        train(ref)
        if references is not None:
            references[key] = ref_dir
    return compare(root / "layout", ref_dir, cfg.parallel.describe())
