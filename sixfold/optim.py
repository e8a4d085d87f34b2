"""AdamW over flat buffers, global grad-norm clipping and the learning-rate schedule."""
from __future__ import annotations

import math

import torch

from .config import TrainConfig
from .parallel.sharding import FlatParameters


class AdamW:
    """torch.optim.AdamW's fused kernel over the parameters, which are views of the flat buffers.

    Norm weights (`no_decay`) take no weight decay. State is exposed by global parameter name.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, no_decay):
        self.named = dict(model.named_parameters())
        groups = [{"params": [p for n, p in self.named.items() if not no_decay(n)], "weight_decay": cfg.weight_decay},
                  {"params": [p for n, p in self.named.items() if no_decay(n)], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)

    @property
    def step_count(self) -> int:
        state = next(iter(self.opt.state.values()), None)
        return int(state["step"]) if state else 0

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()

    def _init_state(self) -> None:
        for p in self.named.values():
            if p not in self.opt.state:
                self.opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                     "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Optimizer state by global parameter name."""
        self._init_state()
        out = {}
        for n, p in self.named.items():
            out[f"{n}.exp_avg"] = self.opt.state[p]["exp_avg"]
            out[f"{n}.exp_avg_sq"] = self.opt.state[p]["exp_avg_sq"]
        return out

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor], step_count: int) -> None:
        for name, t in self.state_tensors().items():
            t.copy_(tensors[name])
        for p in self.named.values():
            self.opt.state[p]["step"].fill_(step_count)


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
