"""The model's layers cut into pipeline stages: the embedding, the blocks, and the final norm with the head,
in contiguous runs balanced by their compute (forward FLOPs per token, the embedding and head included)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate

from ...config import ConfigError, ModelConfig
from .schedules import LEAST_V
from .simulate import Costs


@dataclass(frozen=True)
class Stage:
    index: int
    layers: range  # global block indices
    embed: bool  # the first stage: looks the tokens up
    head: bool  # the last stage: final norm, head and loss


def whole(cfg: ModelConfig) -> Stage:
    """The whole model as one stage."""
    return Stage(0, range(cfg.n_layers), True, True)


def _block_costs(cfg: ModelConfig, seq_len: int, layer: int) -> tuple[float, float, float]:
    """Forward FLOPs per token of block `layer`'s attention products, of its MLP (an MoE layer's: the router, the
    top_k experts a token visits and a shared expert) and of its attention core."""
    d, hd = cfg.dim, cfg.head_dim
    products = 2 * d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = 2 * 3 * d * cfg.ffn_dim
    if layer in cfg.moe_layers:
        mlp = mlp * (cfg.moe_top_k + cfg.moe_shared_expert) + 2 * d * cfg.moe_experts
    attention = 2 * cfg.n_heads * hd * seq_len  # scores and weighted values over half the sequence (causal)
    return float(products), float(mlp), float(attention)


def layer_costs(cfg: ModelConfig, seq_len: int) -> list[float]:
    """Forward FLOPs per token of the embedding, each block, and the head (norm, logits, cross-entropy)."""
    blocks = [sum(_block_costs(cfg, seq_len, i)) for i in range(cfg.n_layers)]
    return [2.0 * cfg.dim] + blocks + [2.0 * cfg.dim * cfg.vocab_size + 5.0 * cfg.vocab_size]


def _recomputed(cfg: ModelConfig, seq_len: int, layer: int) -> float:
    """Forward FLOPs per token that cfg.recompute runs again in block `layer`'s backward: the block (but an MoE
    layer's MLP), or its attention core."""
    products, mlp, attention = _block_costs(cfg, seq_len, layer)
    full = products + attention + (0.0 if layer in cfg.moe_layers else mlp)
    return {"full": full, "selective": attention}.get(cfg.recompute, 0.0)


def stage_costs(cfg: ModelConfig, stages: list[Stage], seq_len: int, split: bool) -> Costs:
    """The simulator's costs of each stage from its FLOPs, in units of the mean stage's forward: F its forward; B
    and W as much again each (the gradients of the input and of the weights), but the attention core, which has no
    weights, twice in B and not in W, and without W actions (split) the head's weight gradient in B (a B that sends
    early defers the blocks' only); B more by what cfg.recompute runs again (_recomputed)."""
    costs = layer_costs(cfg, seq_len)  # piece p: the embedding (0), block p - 1, or the head (last)
    f = [(costs[0] if s.embed else 0.0) + sum(costs[1 + i] for i in s.layers) + (costs[-1] if s.head else 0.0)
         for s in stages]
    again = [sum(_recomputed(cfg, seq_len, i) for i in s.layers) for s in stages]
    core = [sum(_block_costs(cfg, seq_len, i)[2] for i in s.layers) for s in stages]
    head = [2.0 * cfg.dim * cfg.vocab_size if s.head and not split else 0.0 for s in stages]
    unit = sum(f) / len(f)
    return Costs(tuple(x / unit for x in f),
                 tuple((x + a + c + h) / unit for x, a, c, h in zip(f, again, core, head)),
                 tuple((x - c - h) / unit for x, c, h in zip(f, core, head)))


def check_stages(cfg: ModelConfig, pp: int, v: int = 1, schedule: str = "1f1b") -> None:
    """Refuse more stages than the model has pieces, naming what `schedule` lets change (zb-v takes 2 stages per
    rank, interleaved at least 2)."""
    stages = pp * v
    if stages > cfg.n_layers + 2:
        blocks = f"{cfg.n_layers} block{'s' if cfg.n_layers > 1 else ''}"
        fewer = "parallel.pp" if v <= LEAST_V.get(schedule, 1) else \
            "parallel.pp or parallel.pp_virtual_stages"
        raise ConfigError(
            f"parallel.pp*parallel.pp_virtual_stages={stages} stages, but the model has only {cfg.n_layers + 2} "
            f"pieces to place (embedding, {blocks}, head): lower {fewer}, or raise model.n_layers to at least "
            f"{stages - 2}")


def split_stages(cfg: ModelConfig, n: int, seq_len: int) -> list[Stage]:
    """n contiguous stages whose largest cost is the least possible."""
    check_stages(cfg, n)
    bounds = _bounds(tuple(layer_costs(cfg, seq_len)), n)
    items = bounds[-1]
    stages = []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        # piece p is the embedding (0), block p - 1, or the head (items - 1)
        stages.append(Stage(s, range(max(a, 1) - 1, min(b, items - 1) - 1), a == 0, b == items))
    return stages


@functools.lru_cache(maxsize=256)  # the planner's search splits the same model into the same counts many times
def _bounds(costs: tuple[float, ...], n: int) -> tuple[int, ...]:
    """Where each of n contiguous stages over the pieces of `costs` begins, and the end: the largest stage's
    cost the least possible."""
    prefix = list(accumulate((0.0, *costs)))
    items = len(costs)
    # best[k][i]: the least largest cost of k stages over the first i pieces; cut[k][i]: where the last begins
    best = [[float("inf")] * (items + 1) for _ in range(n + 1)]
    cut = [[0] * (items + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for i in range(k, items - (n - k) + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    bounds, i = [items], items
    for k in range(n, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return tuple(reversed(bounds))
