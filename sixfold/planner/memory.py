"""Memory of one rank, from the layout alone.

Persistent (between steps): for each FSDP unit of `padded` elements sharded over n ranks (n = 1 without
ZeRO), with b bytes per compute element:
  parameters  b * padded compute weights (under ZeRO-3, which gathers them for use, only those of the two units
              the next step begins with), 4 * padded / n of fp32 master shard when sharded or in bf16, and
              b * padded / n of bf16 shard to gather from
  gradients   b * padded full gradients (ZeRO-0/1; ZeRO-2/3 free them between steps), 4 * padded / n of
              fp32 reduced shard when sharded or in bf16
  optimizer   8 bytes (AdamW's two moments) per parameter element of the shard
Activations (saved for backward, per micro-batch; a per-layer count in the manner of Korthikanti et al. 2022,
for this model: RMSNorm, SwiGLU, rotary embeddings, fused attention that keeps its log-sum-exp), with T tokens
on the rank, T_h the hidden rows (T / tp under sequence-TP), and per tp rank q_dim and kv_dim the query and
key/value widths, a the heads, f the ffn width:
  per block   b * (2 * T_h * dim            each norm's input (its output, the linear's input, is computed
                                            again in the linear's backward; an MoE layer's MLP keeps its input)
                   + 2 * T * q_dim          q after rotation, the attention output (the wo input)
                   + 2 * T * kv_dim         k after rotation, v
                   + 2 * T * f)             gate and up (one product; SwiGLU's output, the w_down input, computed
                                            again; MoE: mlp_activations)
              + 4 * (2 * T_h + T * a)       norm statistics, the attention log-sum-exp
  recompute   full: each sub-layer's input only (2 * b * T_h * dim; an MoE layer's MLP, not run again, saves as
              without: 3 * b * T_h * dim + 4 * T_h + its own); selective: the log-sum-exp is rebuilt (the
              attention output is saved as wo's input all the same)
  context     all-gather KV keeps the gathered keys and values (cp times this rank's, b * 2 * cp * T * kv_dim);
              Ulysses the query at the other head split (b * T * q_dim) and kv heads repeated up to cp where there
              are fewer; neither under selective recomputation
  ends        the final norm (2 * b * T_h * dim and its statistics), the logits (4 * T * vocab / tp; with
              model.loss_chunk the head weight's gradient instead, 4 * vocab * dim), token ids and labels
              (16 * T)
  rotary      the tables (4 * seq / cp * head_dim), once: one set is alive at a time
A pipeline rank keeps each stage's activations for that stage's (stage, micro-batch) pairs in flight, and for a
pair past a B that leaves its weight gradients to a W, what that W needs instead (of the simulator's crowds of
pairs, the largest in bytes). The step's peak (step()) adds the computation's temporaries and transient buffers
at the largest of its moments: the loss (its forward, its backward or the head's), each block's, and under
pipelining an early sender's weight gradient, or a W's.
"""
from __future__ import annotations

import torch

from ..model.causal import in_chunks
from ..model.moe import MoE
from ..parallel.pipeline.delivery import held_sends
from ..parallel.sharding import REDUCING
from .rank import Rank


def persistent(rank: Rank) -> dict[str, int]:
    b, out = rank.compute_bytes, {"parameters": 0, "gradients": 0, "optimizer": 0}
    for u in rank.sharded.units:
        n = rank.ctx.size(u.group) if u.zero else 1
        own_master = n > 1 or b == 2
        full = u.zero < 3 or u in rank.sharded.ahead
        out["parameters"] += (b * u.padded if full else 0) + (4 * u.shard_size if own_master else 0) + \
            (b * u.shard_size if b == 2 and n > 1 else 0)
        out["gradients"] += (b * u.padded if u.zero < 2 else 0) + (4 * u.shard_size if own_master else 0)
        out["optimizer"] += 8 * sum(end - start for _, start, end, _ in u.segments())
    return out


def block_activations(rank: Rank, layer: int, recompute: str) -> int:
    """Bytes one block saves for backward on one micro-batch."""
    cfg, b = rank.cfg.model, rank.compute_bytes
    attn = rank.model.layers[str(layer)].attn
    t, th = rank.micro_tokens, rank.hidden_tokens
    q, kv = attn.n_heads * cfg.head_dim, attn.n_kv_heads * cfg.head_dim
    if recompute == "full":  # each sub-layer's input; an MoE layer's MLP is not run again (model/llama.py)
        if rank.moe(layer) is not None:
            return 3 * b * th * cfg.dim + 4 * th + mlp_activations(rank, layer)
        return 2 * b * th * cfg.dim
    core = b * t * q + (0 if recompute == "selective" else 4 * t * attn.n_heads)  # wo keeps the output anyway
    inputs = 2 * th * cfg.dim if rank.moe(layer) is None else 3 * th * cfg.dim  # and an MoE layer's MLP's input
    saved = b * (inputs + t * q + 2 * t * kv) + mlp_activations(rank, layer) + core + 4 * 2 * th
    cp = rank.model.cp
    if cp.size > 1 and recompute != "selective" and cp.mode == "allgather":  # inside the core selective rebuilds
        saved += b * 2 * (cp.size - 1) * t * kv  # every rank's keys and values, q copied out of the heads' buffer
    if cp.size > 1 and recompute != "selective" and cp.mode == "ulysses":  # kv heads repeated up to cp if fewer
        saved += b * t * q + b * 2 * t * kv * (max(1, cp.size // attn.n_kv_heads) - 1)
    return saved


def mlp_activations(rank: Rank, layer: int) -> int:
    """Bytes a block's MLP saves beyond its input: a dense SwiGLU b * 2 * T * f; an MoE layer, with R = T_h * k
    routed rows (those reaching this rank's experts when routing is balanced over ep), b * R * (3 * dim + 2 * f)
    (the rows in, each expert's gate and up (one tensor), the outputs out and weighted) and
    its routing (probabilities and log-sum-exp inputs 8 * T_h * E, the top k, their sum, weights and row indices
    (28 + b) * R + 8 * T_h), plus a shared expert as a dense SwiGLU."""
    cfg, b, th = rank.cfg.model, rank.compute_bytes, rank.hidden_tokens
    moe = rank.moe(layer)
    if moe is None:
        return _swiglu(rank, rank.model.layers[str(layer)].mlp)
    rows, experts = rank.routed_rows, cfg.moe_experts
    out = b * rows * (3 * cfg.dim + 2 * cfg.ffn_dim) + (28 + b) * rows + 8 * th * experts + 8 * th + 4 * experts
    return out + (_swiglu(rank, moe.shared) if moe.shared is not None else 0)


def _swiglu(rank: Rank, mlp, working: bool = False) -> int:
    """A dense SwiGLU's saved bytes beyond its input, b * 2 * T * f: gate and up (one product; w_down computes its
    input from them again). working: its backward's temporaries instead, b * 4 * T * f: the incoming gradient,
    the stacked gate and up gradient and silu(gate) again."""
    return rank.compute_bytes * (4 if working else 2) * rank.micro_tokens * mlp.w_gate.weight.shape[0]


def mlp_working(rank: Rank, layer: int, deferring: bool = False) -> int:
    """Temporaries of a block's MLP backward: a dense SwiGLU's (_swiglu); an MoE layer's routed rows' gradient,
    b * R * dim, and one expert's at a time, silu(gate) and its SwiGLU again, then the gate and up gradients,
    b * 2 * (R / local experts) * f (deferring its weight gradients: every expert's SwiGLU and gradients,
    b * 3 * R * f), or a shared expert's, whichever is larger."""
    cfg, b, moe = rank.cfg.model, rank.compute_bytes, rank.moe(layer)
    if moe is None:
        return _swiglu(rank, rank.model.layers[str(layer)].mlp, working=True)
    rows, local = rank.routed_rows, moe.experts.w_gate.shape[0]
    routed = b * rows * cfg.dim + (b * 3 * rows * cfg.ffn_dim if deferring else
                                   b * 2 * -(-rows // local) * cfg.ffn_dim)
    return max(routed, _swiglu(rank, moe.shared, working=True) if moe.shared is not None else 0)


def deferred(rank: Rank, layer: int) -> tuple[int, int]:
    """Bytes a block's deferred weight gradients hold until they are computed, which its backward does not free:
    each linear's output gradient (a row linear's gathered over sequence-TP) and input (a column linear's gathered
    over sequence-TP, computed again); and the largest weight gradient one of them
    makes (stacked weights in one product). MoE experts hold their rows in and their output gradient, b * R * dim
    each, and per row the SwiGLU and the gate and up gradients, b * R * 3 * f (their products add into the
    gradient in place); a shared expert defers as a dense SwiGLU."""
    cfg, b, t = rank.cfg.model, rank.compute_bytes, rank.micro_tokens
    block = rank.model.layers[str(layer)]
    attn, dense = block.attn, block.mlp.shared if isinstance(block.mlp, MoE) else block.mlp
    q, kv = attn.n_heads * cfg.head_dim, attn.n_kv_heads * cfg.head_dim
    held = b * t * ((q + 2 * kv) + cfg.dim + cfg.dim + q)  # qkv: gradient, input; wo: gradient, input
    products = [attn.wq.weight.numel() + attn.wk.weight.numel() + attn.wv.weight.numel(), attn.wo.weight.numel()]
    if dense is not None:
        f = dense.w_gate.weight.shape[0]
        held += b * t * (2 * f + cfg.dim + cfg.dim + f)  # gate and up: gradient, input; w_down: gradient, input
        products += [dense.w_gate.weight.numel() + dense.w_up.weight.numel(), dense.w_down.weight.numel()]
    if rank.moe(layer) is not None:
        held += b * rank.routed_rows * (2 * cfg.dim + 3 * cfg.ffn_dim)
    return held, b * max(products)


def waiting(rank: Rank, stage) -> tuple[int, int]:
    """Bytes a micro-batch holds on `stage` from a B that leaves its weight gradients to a W until that W: its
    blocks' deferred tensors and, on the head's stage, the head's input and logits' gradient (the head's weight
    gradient waits for the W too, unless model.loss_chunk computes it inside the loss); and the largest weight
    gradient the W makes."""
    held = [deferred(rank, layer) for layer in stage.layers]
    if stage.head and not rank.cfg.model.loss_chunk:
        b, t, dim, vocab = rank.compute_bytes, rank.micro_tokens, rank.cfg.model.dim, _vocab(rank)
        held.append((b * t * (dim + vocab), b * vocab * dim))
    return sum(h for h, _ in held), max((p for _, p in held), default=0)


def ends(rank: Rank) -> int:
    """Bytes the head's rank saves for backward at the model's ends per micro-batch: the final norm, the logits
    (or with model.loss_chunk the head weight's gradient), token ids and labels."""
    if rank.model.norm is None:
        return 0
    cfg, t, th, vocab = rank.cfg.model, rank.micro_tokens, rank.hidden_tokens, _vocab(rank)
    logits = 4 * vocab * cfg.dim if cfg.loss_chunk else 4 * t * vocab
    return 2 * rank.compute_bytes * th * cfg.dim + 4 * th + logits + 16 * t


def _vocab(rank: Rank) -> int:
    """The head's rows on this rank (its tp share of the vocabulary)."""
    return rank.model.head_layer.weight.shape[0]


def activations(rank: Rank) -> dict[str, int]:
    """Bytes saved for backward on this rank at the peak: the largest of the simulated schedule's crowds of
    (stage, micro-batch) pairs in flight (crowds()); and the rotary tables once (a pipeline step makes one set for
    all its micro-batches; without pipelining, one micro-batch's are freed before the next's are made), and so the
    document masks of every micro-batch under pipelining, of one without."""
    return {"saved": max(n for _, n in crowds(rank)) + _shared(rank)}


def crowds(rank: Rank, backward: bool = False) -> list[tuple[tuple[tuple[int, int, int], ...], int]]:
    """Each crowd of (stage, pairs, pairs waiting for their W) the simulated schedule has alive at once on this
    rank (without pipelining, one pair: each backward follows its forward), or with `backward` as a B begins, with
    its bytes: each pair's stage activations, or past its B, what it holds for its W (waiting())."""
    own = {st.index: _stage_activations(rank, st) for st in rank.model.stages}
    held = {st.index: waiting(rank, st)[0] for st in rank.model.stages}
    alive = [tuple((i, 1, 0) for i in own)] if not rank.pipeline else \
        rank.pipeline.backward_crowds if backward else rank.pipeline.crowds
    return [(crowd, sum((n - w) * own[s] + w * held[s] for s, n, w in crowd)) for crowd in alive]


def _shared(rank: Rank) -> int:
    """Bytes of the rotary tables and document masks, as activations() counts them."""
    rope = 4 * rank.cfg.train.seq_len // rank.model.cp.size * rank.cfg.model.head_dim if rank.blocks else 0
    return rope + document_masks(rank) * (rank.cfg.train.micro_batches if rank.schedule else 1)


def document_masks(rank: Rank) -> int:
    """Bytes of one micro-batch's document masks (data.document_mask), made once for every layer of the rank
    (ContextParallel.document_mask): whole masks, additive in the compute dtype, over its b sequences of S tokens:
    [b, 1, S, S] on one rank and under Ulysses, [b, 1, S/cp, S] under all-gather KV; under the ring at most one
    [b, 1, n, n] and a flag per query [b, n] for each chunk pair it computes, with n = S / chunks (a pair that needs
    no mask has none), on the cp rank that computes the most pairs. Where attention runs in chunks of queries (a
    CPU in fp32, model/causal.py) no whole mask is made: each chunk's is made from the documents' ids."""
    if not rank.cfg.data.document_mask or not rank.blocks:
        return 0
    cp, seq, b = rank.model.cp, rank.cfg.train.seq_len, rank.compute_bytes
    rows = rank.micro_tokens * cp.size // seq
    if cp.size == 1 or cp.mode == "ulysses":
        return b * rows * seq * seq if _whole_masks(rank, seq) else 0
    if cp.mode == "allgather":
        return b * rows * seq // cp.size * seq if _whole_masks(rank, seq // cp.size) else 0
    n = seq // cp.n_chunks
    pairs = max(sum(a + 1 for a in cp.chunks_of(r)) for r in range(cp.size))  # contiguous: the last rank's
    return pairs * rows * n * (b * n * _whole_masks(rank, n) + 1)


def _whole_masks(rank: Rank, queries: int) -> bool:
    """Whether attention over `queries` queries within documents takes whole masks: unless it runs in chunks
    (model/causal.py), which a compiled block on one rank does not (context-parallel attention stays eager)."""
    eager = not rank.cfg.train.compile or rank.model.cp.size > 1
    dtype = torch.bfloat16 if rank.compute_bytes == 2 else torch.float32
    return not (eager and in_chunks("cpu" if rank.cpu else "cuda", dtype, queries, masked=True))


def _stage_activations(rank: Rank, stage) -> int:
    """Bytes one micro-batch saves for backward on one of the rank's stages: its blocks, and the ends if it has the
    head."""
    blocks = sum(block_activations(rank, layer, rank.cfg.model.recompute) for layer in stage.layers)
    return blocks + (ends(rank) if stage.head else 0)


def step(rank: Rank) -> dict[str, int]:
    """Bytes a step holds beyond the persistent buffers at its peak, the largest of its moments, by kind:
    "saved" activations, "working" (the computation's own temporaries) and "transient" buffers.
    At the loss (the head's rank): every saved activation; the larger of its logits-sized temporaries (in its
    forward, the logits in the compute dtype beside the fp32 probabilities saved from them, b * T * vocab, its
    backward making the gradient in their place; with model.loss_chunk, in forward, a chunk's (_chunk) and the
    head's input) and the head's backward (unless chunked, the logits' gradient in the compute dtype in place of
    the saved fp32 logits, now freed; _head_backward); the gradients allocated at forward (ZeRO-2/3: the head's, a
    tied embedding's), the gathered weights (ZeRO-3 without pipelining: none yet of those the backward gathers
    again), the pipeline's buffers.
    At the backward of each block, which begins with its MLP: the saved activations less the ends of that
    micro-batch, now freed (and without pipelining those of the blocks gone back before it); the MLP's temporaries
    (mlp_working), two hidden-state gradients, under full recomputation that sub-layer rebuilt (not an MoE layer's,
    which is not run again); all the buffers above and those of the reductions then (_reducing). The saved
    activations are the crowd's alive as a B begins. The MLP of a B that defers holds w_down's output gradient and
    input and its experts' deferred tensors (mlp_working). Without pipelining, as each layer's reductions start,
    its backward done: the saved activations of the blocks still to go back, a hidden-state gradient and the
    reductions then in flight, one more than at a block's backward (_launches).
    Under pipelining, at the weight gradient of a B that sent its input gradient first (Schedule.sends_early):
    the saved activations less that B's micro-batch's on its stage (freed by the B), that stage's deferred
    tensors and its largest weight gradient (deferred()), the input gradient it sent, and the buffers of the
    first moment (its units start reducing after it). At a W: a crowd its pair waits in (waiting()) and the
    largest weight gradient it makes, with the same buffers."""
    b, th, dim = rank.compute_bytes, rank.hidden_tokens, rank.cfg.model.dim
    shared, alive = _shared(rank), crowds(rank)
    saved = max(n for _, n in alive) + shared  # activations(), from the crowds the W's moments read too
    buffers = _buffers(rank)
    at_loss = buffers["early"] - buffers["again"]  # the backward has gathered nothing again yet
    moments = [{"saved": saved, "working": 0, "transient": at_loss}]
    if rank.model.norm is not None:
        vocab, chunk, t = _vocab(rank), rank.cfg.model.loss_chunk, rank.micro_tokens
        head = _head_backward(rank)
        # unchunked, by then the saved fp32 logits (in ends()) are freed and their gradient is in the compute dtype
        if chunk:  # in forward, beside the head's input
            loss = max(_chunk(rank, t > chunk) * min(chunk, t) * vocab + b * t * dim, head)
        else:
            loss = max(b * t * vocab, head - (4 - b) * t * vocab)
        moments.append({"saved": saved, "working": loss, "transient": at_loss})
    pp = rank.ctx.rank_in("pp")
    early = {s for s, _ in rank.schedule.sends_early(pp)} if rank.schedule else set()
    split = {s for s, _ in rank.schedule.split(pp)} if rank.schedule else set()
    if rank.blocks:
        before = max(n for _, n in crowds(rank, backward=True)) + shared - ends(rank)  # as a B begins
        reducing, gone = _reducing(rank, buffers["early"]), 0
        for st in rank.model.stages:
            for layer in reversed(st.layers):
                moe = rank.moe(layer)
                full = rank.cfg.model.recompute == "full" and moe is None  # an MoE layer's MLP is not run again
                rebuilt = 4 * th + mlp_activations(rank, layer) if full else 0
                deferring = st.index in early | split
                # a dense w_down's output gradient and input, computed again (a shared expert's too), wait for its
                # weight gradient
                dense = rank.model.layers[str(layer)].mlp if moe is None else moe.shared
                down = b * rank.micro_tokens * (dim + dense.w_gate.weight.shape[0]) if deferring and dense else 0
                working = mlp_working(rank, layer, deferring) + down
                moments.append({"saved": before - gone, "working": rebuilt + working + 2 * b * th * dim,
                                "transient": reducing[layer]})
                if rank.schedule is None:  # the one micro-batch's blocks gone back free what they saved
                    gone += block_activations(rank, layer, rank.cfg.model.recompute)
        gone = 0
        for layer, transient in _launches(rank, buffers["early"]):  # a hidden-state gradient on its way back
            gone += block_activations(rank, layer, rank.cfg.model.recompute) if layer is not None else 0
            moments.append({"saved": before - gone, "working": b * th * dim, "transient": transient})
    sent = b * th * dim  # an early sender's input gradient, on its way
    for st in (st for st in rank.model.stages if st.index in early):
        held = [deferred(rank, layer) for layer in st.layers]
        gone = _stage_activations(rank, st)  # its B is done: the micro-batch's saved tensors freed but for `held`
        working = sum(h for h, _ in held) + max((p for _, p in held), default=0) + sent
        moments.append({"saved": saved - gone, "working": working, "transient": buffers["early"]})
    products = {st.index: waiting(rank, st)[1] for st in rank.model.stages if st.index in split}
    for crowd, held in alive:  # a W: its pair waits in the crowd alive then; the product it makes
        for s, _, w in crowd:
            if w and s in products:
                moments.append({"saved": held + shared, "working": products[s], "transient": buffers["early"]})
    peak = max(moments, key=lambda m: sum(m.values()))
    peak["transient"] += buffers["held"]
    return peak


def _head_backward(rank: Rank) -> int:
    """Bytes the head's backward makes: its input's gradient, b * T * dim, and its weight's, b * vocab * dim; under
    sequence-TP also its input gathered again (b * T * dim) and the reduce-scatter's output of the input's
    gradient (b * T_h * dim), and on a CPU the reduce-scatter's staged input and gloo's own copy of the gather, which
    is freed before the weight's gradient is made (b * T * dim each)."""
    b, dim, t = rank.compute_bytes, rank.cfg.model.dim, rank.micro_tokens
    weight = b * _vocab(rank) * dim
    if not rank.model.tp.sequence:
        return weight + b * t * dim
    staged = b * t * dim if rank.cpu else 0
    return 2 * b * t * dim + b * rank.hidden_tokens * dim + staged + max(weight, staged)


def _chunk(rank: Rank, more: bool) -> int:
    """Bytes per logit of a chunk of the fused head and loss (model/head_loss.py) as it computes: on a GPU
    (compiled) its logits, their fp32 copy and gradient; on a CPU (eager) its logits, their fp32 copy (of bf16
    ones), the target's flags (bool), exp, the flags as fp32 and their difference, and with `more` chunks the last
    chunk's gradient, held while the next is computed."""
    b = rank.compute_bytes
    if not rank.cpu:
        return 4 + 2 * b
    return b + (4 if b == 2 else 0) + 1 + 3 * 4 + (b if more else 0)


def _reducing(rank: Rank, early: int) -> dict[int, int]:
    """Each block's "reducing" buffers as its backward runs, with the `early` ones: without pipelining
    (Sharded.launch), its own units' full gradients (ZeRO-2/3) and, of the units whose backward is done, the last
    REDUCING that wait for their reduction: their full gradients, their copies in the reduction's dtype and on a CPU
    the input their reduce-scatter stages (Comm.reduce_scatter) and gloo's copy of the gathers it starts
    (_gathering); under pipelining, at every block, the copies of the REDUCING + 1 largest units (their full
    gradients are early)."""
    if rank.schedule is not None:
        copies = sorted(_copy(rank, u) for u in rank.sharded.units)
        return dict.fromkeys(rank.blocks, early + sum(copies[-(REDUCING + 1):]))

    of_block, out, done = _of_block(rank), {}, []
    for units in rank.sharded.layers:  # in the order the backward reaches them
        layer = next((of_block[id(m)] for u in units for m in u.modules if id(m) in of_block), None)
        if layer is not None:
            out[layer] = early + sum(_later(rank, u) for u in units) + sum(_held(rank, u) for u in done[-REDUCING:]) + \
                _gathering(rank, units)
        done += [u for u in units if u.zero >= 2 or _held(rank, u)]
    return out


def _launches(rank: Rank, early: int) -> list[tuple[int | None, int]]:
    """Without pipelining, as the reductions of each layer's units start, its backward done (its block, or None for
    the ends): the "reducing" buffers of those units and of the REDUCING started before them, all in flight until
    Sharded.launch waits for the oldest; the `early` ones but of the units reduced by then (ZeRO-2/3 free
    their full gradients); and gloo's copy of the gathers its backward started, waited for by the next layer's
    (_gathering)."""
    if rank.schedule is not None:
        return []
    of_block, out, done = _of_block(rank), [], []
    for units in rank.sharded.layers:
        done += [u for u in units if u.zero >= 2 or _held(rank, u)]
        layer = next((of_block[id(m)] for u in units for m in u.modules if id(m) in of_block), None)
        freed = sum(rank.compute_bytes * u.padded for u in done[:-(REDUCING + 1)] if u.zero >= 2 and not
                    _later(rank, u))
        out.append((layer, early - freed + sum(_held(rank, u) for u in done[-(REDUCING + 1):]) +
                    _gathering(rank, units)))
    return out


def _gathering(rank: Rank, units) -> int:
    """On a CPU, bytes gloo holds for the ZeRO-3 gathers a layer's backward starts (the next layer's weights,
    prefetched) until they complete: its all-gather receives into a flat tensor of the output's size, then copies
    it out (ProcessGroupGloo). None on a GPU."""
    if not rank.cpu:
        return 0
    s = rank.sharded
    started = s.prefetch.get(units[0].index, []) + s.prefetch_after.get(units[-1].index, [])
    return sum(rank.compute_bytes * u.padded for u in started if u.gathers_for_backward and not u.keep_gathered)


def _of_block(rank: Rank) -> dict[int, int]:
    """id of each block module -> its layer."""
    return {id(rank.model.layers[str(layer)]): layer for layer in rank.blocks}


def _held(rank: Rank, u) -> int:
    """Bytes a unit holds while its reduction is in flight: its full gradients (ZeRO-2/3), their copy in the
    reduction's dtype and on a CPU the input its reduce-scatter stages (Comm.reduce_scatter)."""
    staged = rank.reduce_bytes * u.padded if rank.cpu and u.zero and rank.ctx.size(u.group) > 1 else 0
    return _later(rank, u) + _copy(rank, u) + staged


def _later(rank: Rank, u) -> int:
    """Bytes of a ZeRO-2/3 unit's full gradients that live from its backward until it is reduced (none for the
    others, and for those from forward: the head's, a tied embedding's; with pipelining, or several micro-batches
    not reduced each, every unit's from the step's start)."""
    t = rank.cfg.train
    whole = rank.schedule is not None or (t.micro_batches > 1 and not t.reduce_each_micro_batch)
    return rank.compute_bytes * u.padded if u.zero >= 2 and not (u.grad_at_forward or whole) else 0


def _copy(rank: Rank, u) -> int:
    """Bytes of the copy of a unit's gradients in the reduction's dtype while it is reduced (zero 0 reduces bf16 in
    the fp32 shard itself; nothing is cast where nothing is sent)."""
    b, c = rank.compute_bytes, rank.reduce_bytes
    return c * u.padded if b != c and (u.zero or b == 4) and rank.ctx.size(u.group) > 1 else 0


def _buffers(rank: Rank) -> dict[str, int]:
    """Transient buffers, each alive at the moments step() names: "early", ZeRO-2/3 gradients from forward (with
    pipelining, or several micro-batches not reduced each, every unit's from the step's start); "held" through the
    step, ZeRO-3 gathered weights (all of the rank's under pipelining; else those kept through the step, and of the
    rest a layer's units and the next layer's, prefetched: the two largest, at most, of those the backward gathers
    again, not an embedding's, freed after its forward), less those gathered before
    the step (in persistent()), and under pipelining the most hidden states the rank's sends keep alive at once
    (until the data is known received, delivery.py); "again", of those, the ones gathered again for the backward,
    none of them yet as the forward ends and at the loss (the head's layer and the next are kept from forward).
    Those of the reductions: _reducing."""
    b, units = rank.compute_bytes, rank.sharded.units
    early = sum(b * u.padded for u in units if u.zero >= 2 and not _later(rank, u))
    gathered = [b * u.padded for u in units if u.zero == 3 and (u.keep_gathered or rank.schedule is not None)]
    again = [] if rank.schedule is not None else \
        sorted(sum(b * u.padded for u in layer if u.gathers_for_backward and not u.keep_gathered)
               for layer in rank.sharded.layers)[-2:]
    before = sum(b * u.padded for u in rank.sharded.ahead)  # gathered in the step before, in persistent()
    sends = held_sends(rank.schedule, rank.ctx.rank_in("pp")) if rank.schedule else 0
    pipe = sends * b * rank.hidden_tokens * rank.cfg.model.dim
    return {"early": early, "held": sum(gathered) + sum(again) - before + pipe, "again": sum(again)}
