"""A step's estimated time on a cluster: compute at a fraction of the peak, each group's traffic over the
links it crosses (NVLink inside a node, the network between nodes, ring algorithms' factors), the pipeline
bubble from the simulator (each stage costing its FLOPs, so a lighter stage's bubble holds its wait for the
heaviest), and the data-parallel traffic hidden behind backward compute, but for the reductions that
train.reduce_each_micro_batch waits for at the end of each micro-batch before the last (the tail). Without it, the
gradients of several micro-batches accumulate unreduced and their reductions start in the last micro-batch's
backward (train.py; under pipelining at each stage's last B or W): only that backward, 1/m of the step's, hides them.
The tp, cp and ep collectives run inside each forward and backward, so a stage's idle time in the bubble grows with
them as with its compute; the stages' sends do not.

    step = (compute + exposed tp, cp and ep traffic) / (1 - bubble) + pp traffic + tail
           + max(0, dp traffic - backward compute, dp reductions - the last micro-batch's backward)
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..model.llama import Llama
from ..parallel.sharding import REDUCING
from .devices import Device, peak
from .rank import Rank
from .traffic import step_bytes

EFFICIENCY = 0.5  # the fraction of the dense peak that a training step's kernels reach
WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0}
HIDDEN = ("fsdp", "loss", "dp_replicate", "edp", "pp_ends")  # reduced or gathered while other units compute


@dataclass
class Estimate:
    compute_s: float
    comm_s: dict[str, float]  # per group, the time its traffic takes on the wire
    bubble: float
    step_s: float


def matmul_params(model) -> tuple[int, int]:
    """The parameters of `model` (this rank's part) that multiply activations, dense and expert: all but the
    norms' scales and an embedding that is only looked up (a tied one multiplies where it makes the logits)."""
    head_reads_embedding = model.norm is not None and model.head is None
    return _multiplying(model.named_parameters(), skip_embedding=not head_reads_embedding)


def _multiplying(named, skip_embedding: bool = False) -> tuple[int, int]:
    dense = experts = 0
    for name, p in named:
        if name.endswith("norm.weight") or (name == "embed.weight" and skip_embedding):
            continue
        if ".experts." in name:
            experts += p.numel()
        else:
            dense += p.numel()
    return dense, experts


def attention_flops(seq_len: int, dim: int) -> float:
    """Causal attention's training FLOPs per token and block (scores and their use: 4 * seq * dim, half of them
    masked, times 3 for forward and backward)."""
    return 6 * seq_len * dim


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The whole model's training FLOPs per token, what MFU counts: 6 per multiplying parameter (an expert's
    weighted by top_k / experts) and attention_flops per block; recomputation not counted."""
    dense, experts = _whole_model_params(dataclasses.astuple(cfg))
    return 6 * _active(cfg, dense, experts) + attention_flops(seq_len, cfg.dim) * cfg.n_layers


@functools.lru_cache(maxsize=4)
def _whole_model_params(fields: tuple) -> tuple[int, int]:
    """matmul_params of the whole model of ModelConfig(*fields), built on the meta device once per model (the
    search plans hundreds of layouts of one model)."""
    with torch.device("meta"):
        return matmul_params(Llama(ModelConfig(*fields)))


def _active(cfg: ModelConfig, dense: int, experts: int) -> float:
    """The parameters a token multiplies: the dense ones and top_k of the experts' `experts` parameters."""
    return dense + experts * cfg.moe_top_k / max(cfg.moe_experts, 1)


def _forward(rank: Rank, dense: int, experts: int) -> float:
    """One forward's matrix FLOPs on this rank for its `dense` and `experts` (its 1/ep of them) multiplying
    parameters: 2 per dense parameter per token; per expert parameter, 2 for each of the top_k of all the experts
    that a routed token visits. An MoE layer's experts are whole on every tp rank, which routes its own rows of the
    hidden state: 1/tp of the tokens under sequence-TP, all of them without."""
    routed = _active(rank.cfg.model, 0, experts * rank.ctx.size("ep"))
    return 2 * (dense * rank.micro_tokens + routed * rank.hidden_tokens) * rank.cfg.train.micro_batches


def flops(rank: Rank) -> float:
    """Training FLOPs of one step on this rank: 3 forwards' (backward twice the forward) of its stages' weights,
    attention_flops per block, and the forward again of what recomputation rebuilds (the blocks but an MoE
    layer's MLP, or their attention cores); under tp each rank does 1/tp of the dense work, under cp each its
    tokens."""
    cfg, t = rank.cfg.model, rank.cfg.train
    matmul = 3 * _forward(rank, *matmul_params(rank.model))
    tokens = rank.micro_tokens * t.micro_batches
    attention = attention_flops(t.seq_len, cfg.dim) * tokens * len(rank.blocks) / rank.model.tp.size
    again = ((n, p) for n, p in rank.model.layers.named_parameters()  # an MoE layer's MLP is not run again
             if not (n.split(".")[1] == "mlp" and rank.moe(int(n.split(".")[0])) is not None))
    blocks = _forward(rank, *_multiplying(again))
    extra = {"full": blocks + attention / 3, "selective": attention / 3}.get(cfg.recompute, 0.0)
    return matmul + attention + extra


def estimate(rank: Rank, device: Device, per_node: int) -> Estimate:
    """`per_node`: GPUs per node; ranks fill nodes in order (tp innermost). A group kind's collectives run at the
    network's bandwidth if any group of that kind spans nodes (the step waits for the slowest)."""
    compute = flops(rank) / (peak(device, rank.cfg.train.precision) * EFFICIENCY)
    comm: dict[str, float] = {}
    reductions = 0.0  # of the hidden groups' traffic, the gradients' reductions (not the weights' gathers)

    def seconds(group: str, op: str, nbytes: float) -> float:
        bw = device.inter_bw if rank.ctx.dims.crosses_nodes(group, per_node) else device.intra_bw  # any group
        return nbytes * WIRE[op](rank.ctx.size(group)) / bw

    for key, nbytes in step_bytes(rank).items():
        group, op = key.split("/")
        comm[group] = comm.get(group, 0.0) + seconds(group, op, nbytes)
        if group in HIDDEN and op != "all_gather":
            reductions += seconds(group, op, nbytes)
    bubble = rank.pipeline.bubble if rank.pipeline else 0.0
    hidden = sum(v for g, v in comm.items() if g in HIDDEN)
    in_stage = sum(v for g, v in comm.items() if g not in HIDDEN and g != "pp")  # inside forwards and backwards
    t = rank.cfg.train  # the last REDUCING reductions of each micro-batch before the last: its first units'
    last = [u for u in rank.sharded.units if u.zero >= 2][:REDUCING] if t.reduce_each_micro_batch else []
    tail = (t.micro_batches - 1) * sum(seconds(u.group, "reduce_scatter", rank.reduce_bytes * u.padded) for u in last)
    # reductions start in the last micro-batch's backward unless each micro-batch reduces its own
    last_backward = compute * 2 / 3 / (1 if t.reduce_each_micro_batch else t.micro_batches)
    late = max(0.0, hidden - compute * 2 / 3, reductions - last_backward)
    step = (compute + in_stage) / (1 - bubble) + comm.get("pp", 0.0) + late + tail
    return Estimate(compute, comm, bubble, step)
