"""AdamW over flat buffers, global grad-norm clipping and the learning-rate schedule."""
from __future__ import annotations

import math

import torch

from .config import TrainConfig
from .parallel.sharding import FlatParameters


class AdamW:
    """torch.optim.AdamW's update, run over whole flat buckets (decay skipped on no-decay parameters)."""

    def __init__(self, flat: FlatParameters, cfg: TrainConfig, no_decay):
        self.flat = flat
        self.beta1, self.beta2, self.eps, self.weight_decay = cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay
        self.step_count = 0
        self.exp_avg = [torch.zeros_like(b.data) for b in flat.buckets]
        self.exp_avg_sq = [torch.zeros_like(b.data) for b in flat.buckets]
        self.decayed = [[v for n, v in b.views(b.data).items() if not no_decay(n)] for b in flat.buckets]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        bc1 = 1 - self.beta1 ** self.step_count
        bc2_sqrt = math.sqrt(1 - self.beta2 ** self.step_count)
        for b, m, v, decayed in zip(self.flat.buckets, self.exp_avg, self.exp_avg_sq, self.decayed):
            if self.weight_decay:
                for p in decayed:
                    p.mul_(1 - lr * self.weight_decay)
            m.lerp_(b.grad, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(b.grad, b.grad, value=1 - self.beta2)
            denom = (v.sqrt() / bc2_sqrt).add_(self.eps)
            b.data.addcdiv_(m, denom, value=-lr / bc1)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Optimizer state by global parameter name."""
        out = {}
        for b, m, v in zip(self.flat.buckets, self.exp_avg, self.exp_avg_sq):
            out.update({f"{n}.exp_avg": t for n, t in b.views(m).items()})
            out.update({f"{n}.exp_avg_sq": t for n, t in b.views(v).items()})
        return out

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor], step_count: int) -> None:
        for name, t in self.state_tensors().items():
            t.copy_(tensors[name])
        self.step_count = step_count


def clip_grad_norm(flat: FlatParameters, max_norm: float) -> float:
    """Scale gradients so their global L2 norm is at most max_norm; return the norm before clipping.

    After data-parallel reduction every rank holds the full gradient, so the local norm is global.
    """
    norm = math.sqrt(float(flat.grad_norm_sq()))
    if max_norm > 0 and math.isfinite(norm):
        coef = min(max_norm / (norm + 1e-6), 1.0)
        if coef < 1.0:
            for b in flat.buckets:
                b.grad.mul_(coef)
    return norm


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over warmup_steps, then cosine decay to min_lr at the last step (step is 0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
