"""Tensor parallel: sixfold's sequence-TP beside torch DTensor TP+SP (parallelize_module) on the same workload.

    python bench/tp.py --ranks 2 4 --runs 3

There is no data parallelism: every rank reads the same global batch of 4 sequences, whatever the rank count.
The method (alternating torchrun jobs, timing, memory, the docs table) is bench/common.py's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)

from common import ROWS_PER_RANK, Bench, main, torch_worker
from sixfold.model.llama import RMSNorm, apply_rope, init_weights, rope_tables


# ---- sixfold's Llama with plain torch layers, [batch, seq, dim], the same parameter names and shapes ----

class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, q, bias=False)
        self.wk = nn.Linear(cfg.dim, kv, bias=False)
        self.wv = nn.Linear(cfg.dim, kv, bias=False)
        self.wo = nn.Linear(q, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s = x.shape[:2]
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TorchLlama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        cos, sin = rope_tables(torch.arange(tokens.shape[1]), self.cfg.head_dim, self.cfg.rope_theta)
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def splits(self) -> dict:
        """For sixfold's init_weights: how each parameter is cut from its full tensor (its DTensor placement)."""
        return {name: DTensorSplit(p) for name, p in self.named_parameters()}


class DTensorSplit:
    """The part of sixfold's Split that init_weights uses, for a DTensor parameter."""

    def __init__(self, param):
        self.param = param

    def full_shape(self, shape):
        return shape  # a DTensor's shape is the full one

    def local(self, full):
        # every rank drew the same full tensor: each keeps its piece, no communication
        return distribute_tensor(full, self.param.device_mesh, self.param.placements, src_data_rank=None)


# ---- torch's tensor parallelism ----

def parallelize(model: TorchLlama, mesh) -> None:
    """Tensor parallel with sequence parallel, as torchtitan composes it for Llama."""
    # between sub-layers the residual stream is split by sequence (Shard(1)); attention and the MLP gather it
    # once, run column-parallel in and row-parallel out, and reduce-scatter back to the sequence split
    block_plan = {
        "attn_norm": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                   desired_input_layouts=(Replicate(), None, None)),
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(),
        "mlp.w_down": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.layers:
        parallelize_module(block, mesh, block_plan)
        block.attn.n_heads //= mesh.size()  # this rank's heads
        block.attn.n_kv_heads //= mesh.size()
    # the logits stay split by vocabulary (Shard(-1)) for the loss under loss_parallel, which works on gloo
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })


def build(cfg) -> TorchLlama:
    with torch.device("meta"):  # no full-size weights: parallelize first, then draw each rank's pieces
        model = TorchLlama(cfg.model)
    parallelize(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    model.to_empty(device="cpu")
    init_weights(model, cfg.train.seed)
    return model


def tp_worker(cfg) -> dict:
    # no wrapper and no factor on the loss: every rank computes the whole batch's loss, as in sixfold.
    # The norm weights' gradients stay Partial (summed over ranks where they are read), which DTensor cannot
    # zero in place: drop the gradients after each step, as torch's zero_grad does by default.
    return torch_worker(cfg, lambda model, world: (model, 1), grads_to_none=True, build=build,
                        data_parallel=False, loss_context=loss_parallel)


BENCH = Bench(name="tp", script=__file__, title="Tensor parallel: sixfold sequence-TP vs DTensor TP+SP", side="dtensor",
              label="DTensor TP", layout=lambda world: [f"parallel.tp={world}"],
              describe=lambda world: f"tp={world}, sequence-TP", worker=tp_worker,
              global_batch=lambda world: ROWS_PER_RANK)

if __name__ == "__main__":
    main(BENCH, __doc__.split("\n")[0])
