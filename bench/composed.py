"""sixfold's Llama built from PyTorch's own parts and parallelized as torchtitan composes them: nn.Linear and
nn.Embedding layers in [batch, seq, dim], DTensor tensor parallelism with sequence parallelism
(parallelize_module), FSDP2 (fully_shard, summing gradients as sixfold does) and pipeline stages holding a
contiguous run of the layers. The torch sides of bench/tp.py, bench/fsdp.py and bench/e2e.py.

Weights come from sixfold's init_weights (each parameter drawn at its full shape from (seed, name), then each
rank keeps its DTensor piece), so both sides start from the same model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from sixfold.model.llama import init_weights, rope_frequencies, rope_tables
from sixfold.parallel.pipeline.stages import Stage, whole


# ---- sixfold's Llama with plain torch layers, [batch, seq, dim], the same parameter names and shapes ----

def rope(x, cos, sin):
    """Rotate-half rotary embedding in autograd's own operations (as torchtitan's and Hugging Face's Llama);
    x [batch, heads, seq, head_dim], cos and sin [seq, head_dim]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


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
        q, k = rope(q, cos, sin), rope(k, cos, sin)
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
        self.attn_norm = nn.RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TorchLlama(nn.Module):
    """One pipeline stage of the model (by default all of it): the embedding on the first stage, its blocks
    (under their global indices, as torchtitan keeps them), the final norm and head on the last. A stage
    without the embedding takes the hidden state of sequences of seq_len tokens."""

    def __init__(self, cfg, stage: Stage | None = None, seq_len: int = 0):
        super().__init__()
        stage = stage or whole(cfg)
        self.cfg, self.seq_len = cfg, seq_len
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim) if stage.embed else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in stage.layers})
        self.norm = nn.RMSNorm(cfg.dim, cfg.norm_eps) if stage.head else None
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if stage.head else None

    def forward(self, x):
        seq = self.seq_len
        if self.embed is not None:
            seq = x.shape[1]
            x = self.embed(x)
        tables = rope_tables(torch.arange(seq), rope_frequencies(self.cfg))
        cos, sin = (t[:, 0].repeat(1, 2) for t in tables)  # [seq, head_dim]: both halves' angles
        for block in self.layers.values():
            x = block(x, cos, sin)
        return x if self.head is None else self.head(self.norm(x))

    def splits(self) -> dict:
        """For sixfold's init_weights: how each parameter is cut from its full tensor (its DTensor placement)."""
        return {name: DTensorSplit(p) for name, p in self.named_parameters()}


class DTensorSplit:
    """The part of sixfold's Split that init_weights uses, for a DTensor parameter (a plain one is kept whole)."""

    def __init__(self, param):
        self.param = param

    def full_shape(self, shape):
        return shape  # a DTensor's shape is the full one

    def local(self, full):
        if not isinstance(self.param, DTensor):
            return full
        # every rank drew the same full tensor: each keeps its piece, no communication
        return distribute_tensor(full, self.param.device_mesh, self.param.placements, src_data_rank=None)


# ---- torch's parallelisms ----

def tensor_parallel(model: TorchLlama, mesh) -> None:
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
    for block in model.layers.values():
        parallelize_module(block, mesh, block_plan)
        block.attn.n_heads //= mesh.size()  # this rank's heads
        block.attn.n_kv_heads //= mesh.size()
    # the logits stay split by vocabulary (Shard(-1)) for the loss under loss_parallel, which works on gloo
    ends = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    plan = {name: style for name, style in ends.items() if getattr(model, name) is not None}
    if plan:  # a middle pipeline stage has none of them
        parallelize_module(model, mesh, plan)


def fully_shard_summed(model: nn.Module, mesh=None, reshard_after_forward: bool = True) -> None:
    """FSDP2 with a unit per block, as in sixfold; the root unit holds what is left (the embedding, final norm
    and head: two units in sixfold). The last block is not resharded after its forward: its backward comes next
    (torchtitan's choice, and sixfold's). mesh: the data-parallel ranks (default: all)."""
    from torch.distributed.fsdp import fully_shard  # not before it is used: bench/fsdp.py's memory counts it

    blocks = list(model.layers.values())
    units = [fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
             for i, block in enumerate(blocks)]
    units.append(fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward))
    for unit in units:  # FSDP2 averages over ranks; sum instead, as in sixfold (gloo has no AVG op)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def build(cfg, tp_mesh=None, dp_mesh=None, stage: Stage | None = None, reshard_after_forward: bool = True):
    """The model (or one pipeline stage of it) on meta, tensor-parallel over tp_mesh, then fully sharded over
    dp_mesh, then materialized and filled by sixfold's init_weights: no full-size weights on any rank."""
    with torch.device("meta"):
        model = TorchLlama(cfg.model, stage, cfg.train.seq_len)
    if tp_mesh is not None:
        tensor_parallel(model, tp_mesh)
    if dp_mesh is not None:
        fully_shard_summed(model, dp_mesh, reshard_after_forward)
    model.to_empty(device="cpu")
    init_weights(model, cfg.train.seed)
    return model
