"""LLaMA: RMSNorm, rotary positions, grouped-query attention through SDPA, SwiGLU MLP.

Weights follow the Hugging Face layout (rotate-half RoPE), so interop needs no permutation.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from .causal import causal_attention
from .documents import within_documents
from .fused import attention_heads, norm_again, rms_norm, swiglu_again
from .head_loss import chunked_head_loss
from .moe import MoE
from .visible import Visible
from ..parallel.context import ContextParallel
from ..parallel.expert import ExpertParallel
from ..parallel.pipeline.stages import Stage, whole
from ..parallel.tensor import (Again, Linear, Split, TensorParallel, VocabEmbedding, cross_entropy, gather_vocab,
                               linear, outside_compile)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, split: Split = Split()):
        super().__init__()
        self.eps, self.split = eps, split
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def again(self, x: torch.Tensor) -> tuple[torch.Tensor, Again | None]:
        """The output for a linear layer that computes it again in backward (fused.py norm_again)."""
        return norm_again(x, self.weight, self.eps)


def rope_frequencies(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """The angle per position of each pair of a head's elements [head_dim / 2]: rope_theta ** (-2i / head_dim),
    stretched as model.rope_scaling says (config.py)."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        # 1 where the wavelength is at most rope_original_len / rope_high_freq, 0 from rope_original_len /
        # rope_low_freq on, linear in rope_original_len / wavelength between
        kept = (cfg.rope_original_len * inv_freq / (2 * math.pi) - cfg.rope_low_freq) / \
            (cfg.rope_high_freq - cfg.rope_low_freq)
        kept = kept.clamp(0, 1)
        return (1 - kept) * inv_freq / cfg.rope_factor + kept * inv_freq
    return inv_freq


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [len(positions), 1, head_dim / 2] for global token positions (each angle turns a
    head's pair of elements i and i + head_dim / 2)."""
    angles = positions.float()[:, None, None] * inv_freq
    return angles.cos(), angles.sin()


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for generation of at most `size` tokens in all: each
    layer's are written into tensors of that length (no copy of those before per token), made at its first tokens
    unless made before (generate.kv_cache makes every layer's up front, to refuse one too large before any forward)."""

    def __init__(self, n_layers: int, size: int):
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.length, self.size = 0, size

    def make(self, layer: int, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Layer `layer`'s keys and values for `size` tokens, uninitialized."""
        self.k[layer], self.v[layer] = (torch.empty(batch, heads, self.size, head_dim, dtype=dtype, device=device)
                                        for _ in "kv")

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [b, heads, tokens so far, head_dim] with k and v [b, heads, new tokens, head_dim]."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.size:
            raise ValueError(f"the KV cache holds {self.size} tokens; {end} were given")
        if self.k[layer] is None:
            self.make(layer, *k.shape[:2], k.shape[3], k.dtype, k.device)
        self.k[layer][:, :, start:end], self.v[layer][:, :, start:end] = k, v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


@dataclass
class Tokens:
    """What every layer needs to know about the tokens of one forward."""
    shape: tuple[int, int]  # (batch, this rank's sequence length)
    cos: torch.Tensor  # rotary tables at the tokens' global positions
    sin: torch.Tensor
    sequence_tp: bool  # activations between sub-layers split over tp
    context: bool  # the sequence is split over cp: attention goes through the cp strategy
    cache: KVCache | None = None
    mask: Visible | dict | None = None  # keeps each token to its document (ContextParallel.document_mask)


class Attention(nn.Module):
    """Query heads split over tp; kv heads too, or, when fewer than tp, each replicated on the ranks needing it."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel, cp: ContextParallel):
        super().__init__()
        self.layer, self.tp, self.cp, self.head_dim, self.recompute = layer, tp, cp, cfg.head_dim, cfg.recompute
        kv_parts = min(cfg.n_kv_heads, tp.size)
        self.n_heads, self.n_kv_heads = cfg.n_heads // tp.size, cfg.n_kv_heads // kv_parts
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        kv_split = tp.split(0, kv, kv_parts, partial_grad=kv_parts < tp.size)
        self.wq = Linear(tp, cfg.dim, q, "column")
        self.wk = Linear(tp, cfg.dim, kv, "column", kv_split)
        self.wv = Linear(tp, cfg.dim, kv, "column", kv_split)
        self.wo = Linear(tp, q, cfg.dim, "row")
        self.laid_out = False  # note_laid_out

    def stacked(self) -> list[torch.Tensor]:
        return [self.wq.weight, self.wk.weight, self.wv.weight]

    def forward(self, x: torch.Tensor, t: Tokens, again: Again | None = None) -> torch.Tensor:
        """again: how to compute x again (RMSNorm.again), which is then not saved."""
        (b, s), sp = t.shape, t.sequence_tp
        qkv = linear(self.tp, x, self.stacked(), "column", sp, laid_out=self.laid_out, again=again)
        q, k, v = attention_heads(qkv.view(b, s, self.n_heads + 2 * self.n_kv_heads, self.head_dim),
                                  self.n_heads, self.n_kv_heads, t.cos, t.sin)
        attend = partial(self.context_attention, t=t) if t.context else \
            partial(self._local_attention, cache=t.cache, mask=t.mask)
        if self.recompute == "selective" and torch.is_grad_enabled() and t.cache is None:
            out = checkpoint(attend, q, k, v, use_reentrant=False)  # the core again in backward, not its saves
        else:
            out = attend(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b * s, -1), sp)

    def context_attention(self, q, k, v, t: Tokens) -> torch.Tensor:
        """Attention over the cp group."""
        return self.cp.attention(q, k, v, t.mask)

    def _local_attention(self, q, k, v, cache: KVCache | None, mask: Visible | None) -> torch.Tensor:
        if mask is not None:
            return within_documents(q, k, v, mask)
        s, causal = q.shape[2], True
        if cache is not None:
            past = cache.length
            k, v = cache.extend(self.layer, k, v)
            if past:
                causal = False
                mask = torch.ones(s, past + s, dtype=torch.bool, device=q.device).tril(past)
        if s == 1:  # one query sees every key (a branch: under torch.compile a plain bool, not a symbolic one)
            causal = False
        if causal:
            return causal_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv_heads != self.n_heads)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.w_gate = Linear(tp, cfg.dim, cfg.ffn_dim, "column")
        self.w_up = Linear(tp, cfg.dim, cfg.ffn_dim, "column")
        self.w_down = Linear(tp, cfg.ffn_dim, cfg.dim, "row")
        self.laid_out = False  # note_laid_out

    def stacked(self) -> list[torch.Tensor]:
        return [self.w_gate.weight, self.w_up.weight]

    def forward(self, x: torch.Tensor, sp: bool, again: Again | None = None) -> torch.Tensor:
        """again: how to compute x again (RMSNorm.again), which is then not saved; nor is SwiGLU's output."""
        gate_up = linear(self.tp, x, self.stacked(), "column", sp, laid_out=self.laid_out, again=again)
        h, again = swiglu_again(gate_up)
        return self.w_down(h, sp, again)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel, cp: ContextParallel, ep: ExpertParallel):
        super().__init__()
        self.recompute = cfg.recompute
        norm_split = tp.split(0, cfg.dim, parts=1, partial_grad=tp.sequence)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, norm_split)
        self.attn = Attention(cfg, layer, tp, cp)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, norm_split)
        if layer in cfg.moe_layers:
            self.mlp = MoE(cfg, tp, ep, MLP(cfg, tp) if cfg.moe_shared_expert else None)
        else:
            self.mlp = MLP(cfg, tp)

    def _attend(self, x: torch.Tensor, t: Tokens) -> torch.Tensor:
        h, again = self.attn_norm.again(x)
        return x + self.attn(h, t, again)

    def _ffn(self, x: torch.Tensor, t: Tokens) -> torch.Tensor:
        if isinstance(self.mlp, MoE):
            return x + self.mlp(self.mlp_norm(x), t.sequence_tp)
        h, again = self.mlp_norm.again(x)
        return x + self.mlp(h, t.sequence_tp, again)

    def forward(self, x: torch.Tensor, t: Tokens) -> torch.Tensor:
        """x: [tokens, dim], this rank's 1/tp of the tokens under sequence-TP. With full recomputation each
        sub-layer keeps only its input and runs again in backward (not an MoE layer: its routing statistics
        are counted once)."""
        full = self.recompute == "full" and torch.is_grad_enabled()
        x = checkpoint(self._attend, x, t, use_reentrant=False) if full else self._attend(x, t)
        if full and not isinstance(self.mlp, MoE):
            return checkpoint(self._ffn, x, t, use_reentrant=False)
        return self._ffn(x, t)


class Llama(nn.Module):
    """The stages of the model that one rank holds (by default the whole model), its tp piece of each;
    parameters keep their global names.

    Under context parallelism the tokens given are this rank's cp shard of each sequence (except with a KV
    cache: generation runs whole sequences on every rank).
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None, cp: ContextParallel | None = None,
                 stages: list[Stage] | None = None, ep: ExpertParallel | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TensorParallel()
        self.cp = cp = cp or ContextParallel()
        ep = ep or ExpertParallel()
        self.stages = stages or [whole(cfg)]
        lookup, head = any(s.embed for s in self.stages), any(s.head for s in self.stages)
        # a tied head reads the embedding's rows, so the last stage holds them too
        self.embed = VocabEmbedding(tp, cfg.vocab_size, cfg.dim) if lookup or (head and cfg.tie_embeddings) else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, tp, cp, ep) for s in self.stages for i in s.layers})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, tp.split(0, cfg.dim, parts=1, partial_grad=tp.sequence)) \
            if head else None
        self.head = Linear(tp, cfg.dim, cfg.vocab_size, "column", tp.split(0, cfg.vocab_size, pad=True)) \
            if head and not cfg.tie_embeddings else None
        # the tied embedding is held for one use only (lookup or head): its gradient is summed over the pp ends
        self.tied_across_stages = cfg.tie_embeddings and lookup != head
        self.compiled = False  # compile_blocks

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def splits(self) -> dict[str, Split]:
        """Every parameter's global name -> how this rank's tensor is cut from the full one."""
        return {f"{name}.{p}": m.split for name, m in self.named_modules() if hasattr(m, "split")
                for p, _ in m.named_parameters(recurse=False)}

    def tokens(self, b: int, s: int, device: torch.device, cache: KVCache | None = None,
               documents: torch.Tensor | None = None) -> Tokens:
        """The description of a forward of tokens [b, s] (positions continue the cache, if any); with `documents`,
        the document ids [b, S] of the whole sequences (model/documents.py), attention within each document."""
        context = self.cp.size > 1 and cache is None
        if context:
            positions = self.cp.positions(s, device)
        else:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + s, device=device)
        cos, sin = rope_tables(positions, rope_frequencies(self.cfg, device))
        return self.in_documents(Tokens((b, s), cos, sin, self.tp.uses_sequence(b * s), context, cache), documents)

    def in_documents(self, t: Tokens, documents: torch.Tensor | None) -> Tokens:
        """`t` with attention kept within the documents `documents` [b, S] (None, or no block here: `t` itself)."""
        if documents is None or not self.layers:
            return t
        dtype = next(self.parameters()).dtype
        dense = self.compiled and self.cp.size == 1  # local attention inside a compiled block takes the whole mask
        return replace(t, mask=self.cp.document_mask(documents, t.shape[1], dtype, t.cos.device, dense))

    def run(self, stage: Stage, x: torch.Tensor, t: Tokens) -> torch.Tensor:
        """One stage's forward: token ids [b, s] into the first stage, the hidden state [tokens, dim] into the
        others; out comes the hidden state (from the last stage after the final norm: the head's input)."""
        if stage.embed:
            x = self.embed(x.flatten(), t.sequence_tp)
        for i in stage.layers:
            x = self.layers[str(i)](x, t)
        return self.norm(x) if stage.head else x

    def compile_blocks(self, **options) -> None:
        """torch.compile each block's forward (train.compile; the sharding hooks around them stay eager). Inside, an
        MoE layer stays eager (its shapes and collectives follow the routing), and so does context-parallel
        attention (its collectives; the ring's chunk pairs follow the documents, and a compiled block would guard
        on them and compile again for each pattern), and so do the linear layers' collectives under tp."""
        outside_compile()
        self.compiled = True
        for block in self.layers.values():
            if isinstance(block.mlp, MoE):
                block.mlp.forward = torch.compiler.disable(block.mlp.forward)
            block.attn.context_attention = torch.compiler.disable(block.attn.context_attention)
            block.forward = _unless_generating(block.forward, torch.compile(block.forward, **options))

    @property
    def head_layer(self) -> nn.Module:
        """The layer whose weight makes the logits: the head, or the tied embedding."""
        return self.embed if self.head is None else self.head

    def logits(self, h: torch.Tensor, sp: bool) -> torch.Tensor:
        """This rank's logits [tokens, vocab piece] from the head's input."""
        return linear(self.tp, h, [self.head_layer.weight], "column", sp, head=True)

    def head_input(self, h: torch.Tensor, t: Tokens, last: bool) -> tuple[torch.Tensor, bool]:
        """The head's input from the last stage's output h, and whether it is split over tp (sequence-TP): every
        token's, or with `last` each sequence's last token's (generation's: a prompt's logits are never made)."""
        if not last:
            return h, t.sequence_tp
        b, s = t.shape
        return self.tp.gather(h, t.sequence_tp)[0].view(b, s, -1)[:, -1], False

    def local_logits(self, tokens: torch.Tensor, cache: KVCache | None = None, last: bool = False) -> torch.Tensor:
        """Logits [b*s, this rank's vocab piece] for tokens [b, s] through the whole model ([b, ...] with `last`:
        each sequence's last token's)."""
        t = self.tokens(*tokens.shape, tokens.device, cache)
        logits = self.logits(*self.head_input(self.run(whole(self.cfg), tokens, t), t, last))
        if cache is not None:
            cache.length += tokens.shape[1]
        return logits

    def full_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Full logits from this rank's vocab piece (gathered over tp, without gradient there)."""
        return gather_vocab(self.tp, local, self.cfg.vocab_size)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, last: bool = False) -> torch.Tensor:
        """Full logits [b, s, vocab]; with `last`, [b, 1, vocab], each sequence's last token's."""
        return self.full_logits(self.local_logits(tokens, cache, last)).view(len(tokens), 1 if last else -1,
                                                                            self.cfg.vocab_size)

    def loss(self, h: torch.Tensor, labels: torch.Tensor, sp: bool) -> torch.Tensor:
        """Sum of token cross-entropies in fp32 (labels equal to IGNORE_INDEX count for nothing) from the head's
        input; with model.loss_chunk, head and loss fused over chunks of that many tokens."""
        if self.cfg.loss_chunk:
            return chunked_head_loss(h, self.head_layer.weight, labels.flatten(), self.cfg.loss_chunk)
        split = self.head_layer.split  # this rank's vocabulary rows
        return cross_entropy(self.tp, self.logits(h, sp), labels.flatten(), split.index * split.size,
                             self.cfg.vocab_size)

    def loss_sum(self, tokens: torch.Tensor, labels: torch.Tensor,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
        t = self.tokens(*tokens.shape, tokens.device, documents=documents)
        return self.loss(self.run(whole(self.cfg), tokens, t), labels, t.sequence_tp)


def _unless_generating(eager, compiled):
    """A block's compiled forward, but eager with a KV cache: the cache grows with every token, and a compiled block
    would compile again for each layer and length until dynamo's limit (8), then run eager anyway."""
    return lambda x, t: eager(x, t) if t.cache is not None else compiled(x, t)


def full_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every parameter's global name and full shape (no memory is allocated)."""
    with torch.device("meta"):
        return {n: p.shape for n, p in Llama(cfg).named_parameters()}


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_std(cfg: ModelConfig, name: str) -> float:
    if name.endswith(("attn.wo.weight", "mlp.w_down.weight", "mlp.experts.w_down", "mlp.shared.w_down.weight")):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> None:
    """Draw each parameter at its full global shape from a generator seeded by (seed, name).

    The values therefore do not depend on the layout; a shard is a slice of the same draw.
    """
    splits = model.splits()
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        g = torch.Generator().manual_seed(param_seed(seed, name))
        split = splits[name]
        full = torch.empty(split.full_shape(p.shape), dtype=torch.float32)
        p.copy_(split.local(full.normal_(0.0, init_std(model.cfg, name), generator=g)))


def no_decay(name: str) -> bool:
    """Norm weights take no weight decay."""
    return name.endswith("norm.weight")
