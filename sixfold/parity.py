"""The parity contract: a layout reproduces the single-process run of the same global batch.

Metrics (fp32):
- losses: relative difference |layout - reference| / |reference| at every step, at most LOSS_RTOL (a step both
  skipped without a loss, nan, as a batch of prompts only is, agrees);
- weights: per parameter, RMS(layout - reference) / RMS(reference) after the last step, at most WEIGHT_RTOL;
- gradient norms (before clipping): relative difference at every step, at most NORM_RTOL. AdamW's update hardly
  changes when every step's gradients are scaled alike, so a norm off by one factor throughout (counted twice
  over replicas: sqrt(2)) leaves losses and weights within theirs, yet clips at another threshold and logs another
  grad_norm.
A run resumed from a checkpoint is compared from the step it resumed at.

bf16 runs are held to a looser promise, that they learn like fp32: the last loss within BF16_LOSS_RTOL of the
fp32 reference's, which itself fell by at least LEARNED.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import Checkpoint
from .config import FRESH_START, Config, ConfigError, ParallelConfig
from .launch import run_torchrun
from .logs import read_metrics
from .slices import Reader
from .stop import Stopped
from .train import train

LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-5
NORM_RTOL = 1e-5
BF16_LOSS_RTOL = 0.02
LEARNED = 1.0
LEARN_STEPS = 50  # bf16 learns like fp32 over as many steps


class ParityError(RuntimeError):
    """The two runs of a check could not be compared: the layout's run failed, or the runs differ in their steps."""


QUIET = {"log": {"progress": False, "tensorboard": False, "sample_tokens": 0, "trace": False},
         "checkpoint": {"every": 0, "save_final": True, **FRESH_START}}


@dataclass
class ParityResult:
    layout: str
    steps: int
    loss_rel: float
    weight_rel: float
    worst_param: str
    loss_tol: float = LOSS_RTOL
    weight_tol: float = WEIGHT_RTOL  # inf: not checked
    kept: str = ""  # where the two runs were left to look into, if not where asked
    loss_of: str = "max"  # which steps' losses loss_rel compares: "max" over all, or "last" (bf16 against fp32)
    norm_rel: float = 0.0  # the largest relative difference of a step's gradient norm
    norm_tol: float = NORM_RTOL  # inf: not checked

    @property
    def ok(self) -> bool:
        return self.loss_rel <= self.loss_tol and self.weight_rel <= self.weight_tol and self.norm_rel <= self.norm_tol

    def line(self) -> str:
        weight_tol = "not checked" if math.isinf(self.weight_tol) else f"tol {self.weight_tol:.0e}"
        worst = f"worst {self.worst_param}" if self.worst_param else "all equal"
        return (f"parity {'OK' if self.ok else 'FAILED'}: {self.layout}, {self.steps} steps, "
                f"{self.loss_of} loss rel diff {self.loss_rel:.2e} (tol {self.loss_tol:.0e}), max weight rms-rel diff "
                f"{self.weight_rel:.2e} ({weight_tol}, {worst})"
                + ("" if math.isinf(self.norm_tol) else
                   f", max grad-norm rel diff {self.norm_rel:.2e} (tol {self.norm_tol:.0e})")
                + (f"; both runs are in {self.kept}" if self.kept else ""))


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
    ref = _with(cfg, run_dir, steps, train={"micro_batches": micro, "reduce_each_micro_batch": False})
    ref.parallel = ParallelConfig(timeout_s=cfg.parallel.timeout_s)
    if cfg.train.precision != "fp32":  # bf16 learns like the fp32 run
        ref.train.precision = ref.train.grad_reduce = "fp32"
    return ref


def layout_config(cfg: Config, run_dir: Path, steps: int) -> Config:
    """The layout's run: `steps` steps, quiet, its final checkpoint saved in `run_dir`."""
    return _with(cfg, run_dir, steps)


def reference_key(ref: Config) -> str:
    """Reference runs of equal keys are the same run, wherever it is written."""
    return repr(dataclasses.replace(ref, log=dataclasses.replace(ref.log, run_dir="")))


def _steps(layout_dir: Path, reference_dir: Path) -> tuple[list[dict], list[dict]]:
    """The layout's steps and the reference's same steps (a resumed layout starts later)."""
    a, b = read_metrics(layout_dir), read_metrics(reference_dir)
    same = b[-len(a):] if 0 < len(a) <= len(b) else []
    if not same or [m["step"] for m in a] != [m["step"] for m in same]:
        raise ParityError(f"the layout ran steps {[m['step'] for m in a]}, the reference steps 1 to {len(b)}")
    return a, same


def _weight_diff(layout_dir: Path, reference_dir: Path) -> tuple[float, str]:
    """The largest per-parameter RMS(layout - reference) / RMS(reference) (RMS(layout) where the reference is
    all zeros), and its parameter; inf for a nan, or a parameter that one checkpoint lacks (named)."""
    wa = Reader(Checkpoint(layout_dir), "model").all()
    wb = Reader(Checkpoint(reference_dir), "model").all()
    if wa.keys() != wb.keys():
        name = min(wa.keys() ^ wb.keys())
        return math.inf, f"{name}, in the {'layout' if name in wa else 'reference'}'s checkpoint only"
    worst, weight_rel = "", 0.0
    for name, ref in wb.items():
        scale = float(ref.double().pow(2).mean().sqrt()) or 1.0
        diff = float((wa[name].double() - ref.double()).pow(2).mean().sqrt()) / scale
        diff = math.inf if math.isnan(diff) else diff
        if diff > weight_rel:  # (none where every parameter is equal)
            worst, weight_rel = name, diff
    return weight_rel, worst


def _rel(loss: float, reference: float) -> float:
    """|loss - reference| / |reference|; inf where either is nan (max() would pass a nan over)."""
    rel = abs(loss - reference) / abs(reference)
    return math.inf if math.isnan(rel) else rel


def _norm_rel(norm: float, reference: float) -> float:
    """_rel() of two gradient norms; 0 where they are equal (0 at a skipped step, nan at a non-finite one in both)."""
    if norm == reference or (math.isnan(norm) and math.isnan(reference)):
        return 0.0
    return _rel(norm, reference) if reference else math.inf


def _lossless(step: dict) -> bool:
    return step.get("skipped", False) and math.isnan(step["loss"])


def compare(layout_dir: Path, reference_dir: Path, layout: str) -> ParityResult:
    a, b = _steps(layout_dir, reference_dir)
    loss_rel = max(0.0 if _lossless(x) and _lossless(y) else _rel(x["loss"], y["loss"]) for x, y in zip(a, b))
    norm_rel = max(_norm_rel(x["grad_norm"], y["grad_norm"]) for x, y in zip(a, b))
    return ParityResult(layout, len(a), loss_rel, *_weight_diff(layout_dir, reference_dir), norm_rel=norm_rel)


def compare_learning(layout_dir: Path, reference_dir: Path, layout: str) -> ParityResult:
    """A bf16 run against the fp32 reference: the last losses only (weights reported, not checked)."""
    a, b = _steps(layout_dir, reference_dir)
    pairs = [(x, y) for x, y in zip(a, b) if not _lossless(y)]  # the steps with a loss
    first, last = (pairs[0][1]["loss"], pairs[-1][1]["loss"]) if pairs else (math.nan, math.nan)
    if not first - last >= LEARNED:
        raise ParityError(f"the fp32 reference went from loss {first:.3f} to {last:.3f}, not {LEARNED} lower: too "
                          "few steps to tell whether bf16 learns (sixfold check: give more --steps)")
    loss_rel = _rel(pairs[-1][0]["loss"], last)
    return ParityResult(layout, len(a), loss_rel, *_weight_diff(layout_dir, reference_dir), loss_tol=BF16_LOSS_RTOL,
                        weight_tol=math.inf, loss_of="last", norm_tol=math.inf)


@contextlib.contextmanager
def runs_dir(workdir: str | None, command: str):
    """Where `sixfold COMMAND` puts its runs: `workdir`, or a temporary directory, removed if a signal stops the
    command or a setting is refused, named if it fails otherwise. See settle() for the end."""
    root = Path(workdir or tempfile.mkdtemp(prefix=f"sixfold-{command}-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        yield root
    except (Stopped, KeyboardInterrupt, ConfigError):  # nothing to look into (Interrupted is a KeyboardInterrupt)
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
        raise
    except Exception:
        print(f"sixfold {command}: the runs are in {root}", file=sys.stderr)
        raise


def settle(root: Path, workdir: str | None, ok: bool) -> str:
    """A temporary runs_dir removed when every comparison held; else its path (to name), "" for a `workdir`."""
    if workdir is None and ok:
        shutil.rmtree(root, ignore_errors=True)
    return "" if workdir or ok else str(root)


def check(cfg: Config, steps: int, workdir: str | None = None) -> ParityResult:
    """Run the layout under torchrun and the reference in this process; compare the two (a bf16 layout: that it
    learns like the fp32 reference, compare_learning). Without `workdir` the
    runs go to a temporary directory, removed when parity holds or a signal stops the check, and kept (and named)
    when parity fails."""
    with runs_dir(workdir, "check") as root:
        layout_cfg = layout_config(cfg, root / "layout", steps)
        (root / "layout.yaml").write_text(layout_cfg.to_yaml())
        # the runs' output, like the torchrun job's, is not shown (the paths it names are removed when parity holds)
        with contextlib.redirect_stdout(io.StringIO()):
            if cfg.parallel.world_size > 1:
                proc = run_torchrun(cfg.parallel.world_size, ["train", str(root / "layout.yaml")], capture=True)
                if proc.returncode != 0:
                    raise ParityError(f"the layout run failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}"
                                      f"\n{proc.stderr[-4000:]}")
            else:
                train(layout_cfg)
            train(reference_config(cfg, root / "reference", steps))
        against = compare if cfg.train.precision == "fp32" else compare_learning
        result = against(root / "layout", root / "reference", cfg.parallel.describe())
    result.kept = settle(root, workdir, result.ok)
    return result
