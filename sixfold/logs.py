"""Run output on rank 0: progress bar, a line per logging step, metrics.jsonl, TensorBoard events."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm import tqdm

from .console import console, lose_console
from .files import write_text


def fmt_line(m: dict) -> str:
    parts = [f"step {m['step']:>5}", f"loss {m['loss']:.4f}", f"grad_norm {m['grad_norm']:.3f}",
             f"lr {m['lr']:.2e}", f"tok/s {m['tokens_per_s']:,.0f}"]
    if "mfu" in m:
        parts.append(f"mfu {m['mfu']:.1%}")
    parts += [f"mem {m['peak_mem_gb']:.2f}GiB", f"elapsed {m['elapsed_s']:.1f}s"]
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f}")
    if "expert_share" in m:
        load = " ".join(f"{lo:.2f}-{hi:.2f}" for lo, hi in m["expert_share"].values())
        parts.append(f"moe_loss {m['moe_loss']:.4f} | expert share min-max per layer {load}")
    return " | ".join(parts)


class RunLog:
    """Writes nothing unless `enabled` (only rank 0 logs)."""

    def __init__(self, run_dir: Path, enabled: bool, total: int, start: int, progress: bool, tensorboard: bool):
        self.enabled = enabled
        self.bar = None
        self.tb = None
        self.problem = ""  # why a step's metrics could not be written ("" while they could)
        if not enabled:
            return
        self.file = open(run_dir / "metrics.jsonl", "a")  # begun by start_metrics
        if progress:
            self.bar = _progress_bar(total, start)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # a resumed run's steps replace those the earlier run logged after its checkpoint
            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                    purge_step=start + 1 if 0 < start < total else None)

    def print(self, text: str) -> None:
        if self.enabled:
            console(self.bar.write if self.bar else print, text)

    def step(self, metrics: dict, show: bool) -> None:
        if not self.enabled or self.problem:
            return
        try:
            self.file.write(json.dumps(_strict(metrics)) + "\n")
            self.file.flush()
        except OSError as e:  # the trainer stops every rank after the step (a full disk, a lost mount)
            self.problem = f"rank 0 cannot write {self.file.name} at step {metrics['step']}: {e}"
            return
        if self.tb:
            try:
                for k, v in metrics.items():
                    if k != "step" and isinstance(v, (int, float)):
                        self.tb.add_scalar(k, v, metrics["step"])
            except OSError as e:  # its writer's thread failed to write an earlier one: said as for metrics.jsonl
                self.problem = f"rank 0 cannot write {Path(self.file.name).parent / 'tensorboard'} at step " \
                               f"{metrics['step']}: {e}"
                return
        if show:
            self.print(fmt_line(metrics))
        if self.bar:
            console(self.bar.set_postfix, {"loss": f"{metrics['loss']:.3f}"})
            console(self.bar.update, 1)

    def end_progress(self) -> None:
        """Closes the bar once the steps are done, so that the summaries after it print plainly."""
        if self.bar:
            console(self.bar.close)
            self.bar = None

    def close(self) -> None:
        if not self.enabled:
            return
        self.end_progress()
        if self.tb:
            try:
                self.tb.close()
            except OSError:  # the events it could not write, already reported
                if not self.problem:
                    raise
        try:
            self.file.close()
        except OSError:  # what the failed step left in the buffer, already reported
            if not self.problem:
                raise


def _progress_bar(total: int, start: int) -> tqdm | None:
    """The bar on stderr, drawn at once; None if stderr has gone and is not put aside (lose_console)."""
    for _ in range(2):
        try:
            return tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True,
                        leave=True)
        except OSError:
            lose_console()
    return None


def start_metrics(run_dir: Path, up_to: int, aside: Path | None = None) -> None:
    """Keep metrics.jsonl's lines of steps up to `up_to` (those a resumed run goes on from; none when it starts
    over), so that the steps it runs again replace the earlier ones; the others go to `aside`'s metrics.jsonl,
    if given (where their checkpoints went)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines() if path.is_file() else []
    kept, later = [], []
    for line in lines:
        try:
            step = json.loads(line)["step"]
            (kept if step <= up_to else later).append(line + "\n")
        except (ValueError, KeyError, TypeError):  # a line cut short when the run was killed, or damaged
            continue
    if aside is not None and later:
        write_text(aside / "metrics.jsonl", "".join(later))
    write_text(path, "".join(kept))


def _strict(metrics: dict) -> dict:
    """Strict JSON: a NaN or infinite number (a skipped step's loss or norm) as null, which every reader takes."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """metrics.jsonl's steps, a null number read back as NaN."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: math.nan if v is None else v for k, v in m.items()} for m in lines]
