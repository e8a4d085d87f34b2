"""AdamW over flat buffers, global grad-norm clipping and the learning-rate schedule."""
from __future__ import annotations

import math
from typing import Callable

import torch

from .config import TrainConfig
from .parallel.sharding import Sharded, Unit


MOMENTS = ("exp_avg", "exp_avg_sq")  # the optimizer state a checkpoint keeps per parameter


class AdamW:
    """AdamW on this rank's shard of each unit: the fp32 master weights, their gradients and both moments are
    flat buffers of one layout, updated in place by torch's fused AdamW kernel (the one torch.optim.AdamW's
    fused=True runs) over runs of segments: the norm weights (`no_decay`) take no weight decay.

    Unit by unit, in unit order, so that each unit's updated weights can go out (be gathered) while the next units
    are updated. Unsharded, the master is the parameters' own flat buffer. Gradient clipping's scale is applied
    by the kernel as it reads the gradients (its grad_scale, which it divides by), not by a pass of its own."""

    def __init__(self, sharded: Sharded, cfg: TrainConfig, no_decay):
        self.cfg = cfg
        # the moments end where the last parameter does: a shard's padding has none
        ends = [max((b for _, _, b, _ in unit.segments()), default=0) for unit in sharded.units]
        self.moments = [{k: unit.master.new_zeros(end) for k in MOMENTS} for unit, end in zip(sharded.units, ends)]
        # per unit and decay group (decays, does not): lists of master, gradient and moment views, one per run of
        # segments, and the run's step count (a tensor each, as torch.optim keeps them)
        self.units, self.runs = sharded.units, []
        for unit, moments in zip(sharded.units, self.moments):
            runs = tuple(([], [], [], [], []) for _ in range(2))
            cuts = [(a, b, int(no_decay(name))) for name, a, b, _ in unit.segments()]
            for a, b, group in _merged(cuts):
                views = (unit.master[a:b], unit.grad_shard[a:b], moments["exp_avg"][a:b], moments["exp_avg_sq"][a:b],
                         torch.zeros((), dtype=torch.float32, device=unit.master.device))
                for lst, view in zip(runs[group], views):
                    lst.append(view)
            self.runs.append(runs)
        self.steps = [step for runs in self.runs for group in runs for step in group[4]]

    @property
    def step_count(self) -> int:
        return int(self.steps[0]) if self.steps else 0

    @torch.no_grad()
    def step(self, lr: float, updated: Callable[[Unit], None] | None = None, scale: float = 1.0) -> None:
        """One update from the gradients times `scale` (the kernel leaves them so scaled); `updated(unit)` is called
        as each unit's is done."""
        c = self.cfg
        if self.steps:
            torch._foreach_add_(self.steps, 1)
        # a fill, not a copy from the host: nothing waits for the device. The divisor is a float32: one past its
        # range (the clip of a norm above 3.4e38 x train.grad_clip) is taken in two, a power of two multiplied into
        # the gradients first (exact) and the rest
        shift = max(0, math.frexp(1 / scale)[1] - 127)
        divisor = (torch.full((), math.ldexp(1 / scale, -shift), device=self.steps[0].device)
                   if self.steps and scale != 1.0 else None)
        for unit, runs in zip(self.units, self.runs):
            for (weights, grads, exp_avg, exp_avg_sq, steps), decay in zip(runs, (c.weight_decay, 0.0)):
                if weights:
                    if shift:
                        torch._foreach_mul_(grads, math.ldexp(1.0, -shift))
                    torch._fused_adamw_(weights, grads, exp_avg, exp_avg_sq, [], steps, lr=lr, beta1=c.beta1,
                                        beta2=c.beta2, weight_decay=decay, eps=c.eps, amsgrad=False, maximize=False,
                                        grad_scale=divisor)
            if updated is not None:
                updated(unit)

    def set_step_count(self, count: int) -> None:
        for t in self.steps:
            t.fill_(count)


def _merged(cuts: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Adjacent (start, end, group) ranges of one group joined."""
    out: list[tuple[int, int, int]] = []
    for a, b, g in cuts:
        if out and out[-1][1] == a and out[-1][2] == g:
            out[-1] = (out[-1][0], b, g)
        else:
            out.append((a, b, g))
    return out


def clip_scale(norm: float, max_norm: float) -> float:
    """The factor that brings gradients of global L2 norm `norm` to at most max_norm (1: none; 0 turns clipping off)."""
    if max_norm > 0 and math.isfinite(norm):
        return min(max_norm / (norm + 1e-6), 1.0)
    return 1.0


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over warmup_steps, then lr until the decay, which takes the last decay_steps steps (0, or more
    than are left: every step after the first after warmup) below lr down to min_lr at the last, as a cosine or a
    line; `constant` stays at lr. decay_steps below the run's length after warmup makes a warmup-stable-decay
    schedule. A single step after warmup runs at lr; step is 0-based."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    first = max(cfg.warmup_steps, cfg.steps - cfg.decay_steps - 1) if cfg.decay_steps else cfg.warmup_steps
    if cfg.schedule == "constant" or step <= first:
        return cfg.lr
    progress = min((step - first) / max(cfg.steps - first - 1, 1), 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * shape
