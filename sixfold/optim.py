"""AdamW over flat buffers, global grad-norm clipping and the learning-rate schedule."""
from __future__ import annotations

import math

import torch

from .config import TrainConfig
from .parallel.sharding import Sharded


MOMENTS = ("exp_avg", "exp_avg_sq")  # the optimizer state a checkpoint keeps per parameter


class AdamW:
    """torch.optim.AdamW's fused kernel over this rank's shard of each unit, one segment per parameter.

    Norm weights (`no_decay`) take no weight decay. Unsharded, the segments are the parameters themselves.
    """

    def __init__(self, sharded: Sharded, cfg: TrainConfig, no_decay):
        self.sharded = sharded
        self.segments: list[list[tuple[int, int, torch.Tensor]]] = []  # per unit: (start, end, view of master)
        groups = ([], [])
        for unit in sharded.units:
            self.segments.append([])
            for name, a, b, _ in unit.segments():
                view = unit.master[a:b]
                view.grad = unit.grad_shard[a:b]
                self.segments[-1].append((a, b, view))
                groups[no_decay(name)].append(view)
        self.opt = torch.optim.AdamW([{"params": groups[0], "weight_decay": cfg.weight_decay},
                                      {"params": groups[1], "weight_decay": 0.0}],
                                     lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)

    @property
    def step_count(self) -> int:
        state = next(iter(self.opt.state.values()), None)
        return int(state["step"]) if state else 0

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()

    def state_of(self, view: torch.Tensor) -> dict:
        if view not in self.opt.state:
            self.opt.state[view] = {"step": torch.zeros((), dtype=torch.float32, device=view.device),
                                    "exp_avg": torch.zeros_like(view), "exp_avg_sq": torch.zeros_like(view)}
        return self.opt.state[view]

    def set_step_count(self, count: int) -> None:
        for segments in self.segments:
            for _, _, view in segments:
                self.state_of(view)["step"].fill_(count)


def clip_grad_norm(sharded: Sharded, max_norm: float) -> float:
    """Scale gradients so their global L2 norm is at most max_norm; return the norm before clipping.

    Shards are disjoint and replicas equal, so the norm sums shards over the fsdp group only.
    """
    norm = math.sqrt(sharded.grad_norm_sq())
    if max_norm > 0 and math.isfinite(norm):
        coef = min(max_norm / (norm + 1e-6), 1.0)
        if coef < 1.0:
            sharded.scale_grads(coef)
    return norm


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over warmup_steps, then cosine decay to min_lr at the last step (step is 0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
