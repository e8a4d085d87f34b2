"""The bytes one rank sends per training step, by (group, op), in the ledger's terms (all-gathers count their
output, reduce-scatters their input, sends their payload), from the layout alone.

Per step: each unit's gradient reduction (all-reduce over the loss group, or ZeRO's reduce-scatter over fsdp, at
ZeRO-2/3 with train.reduce_each_micro_batch one per micro-batch, then across replicas under HSDP) and ZeRO-1/2's
weight all-gather; ZeRO-3's gathers (once per step per unit kept gathered or under pipelining, otherwise before each
forward and each backward that reads the weights; a step gathers its first two units' during the step before, in the
optimizer, and the next step's in its own); the tied embedding's sum over the pipeline ends; the tp sum of gradients
each tp replica holds part of; the scalars (token count, loss, gradient norm). Per micro-batch: tensor-parallel
collectives per block and at the ends (parallel/tensor.py), context-parallel ones per block
(ContextParallel.comm_bytes), again for what recomputation reruns, and each MoE layer's expert counts and
all-to-alls (for balanced routing); per step, the pipeline sends of the schedule and the MoE losses.
"""
from __future__ import annotations

from collections import Counter

from ..parallel.pipeline.schedules import SEND_B, SEND_F
from ..parallel.tensor import block_bytes, embedding_bytes, head_bytes
from .rank import Rank

SCALAR = 8  # sum_scalars sends fp64


def step_bytes(rank: Rank) -> dict[str, int]:
    """'group/op' -> bytes this rank sends in one training step."""
    out: Counter = Counter()
    _gradients(rank, out)
    _scalars(rank, out)
    for _ in range(rank.cfg.train.micro_batches):
        _tensor(rank, out)
        _context(rank, out)
        _experts(rank, out)
    _pipeline(rank, out)
    return {k: v for k, v in out.items() if v}


def _add(rank: Rank, out: Counter, group: str, op: str, nbytes: int) -> None:
    if rank.ctx.size(group) > 1:
        out[f"{group}/{op}"] += nbytes


def _gradients(rank: Rank, out: Counter) -> None:
    sharded, b, r = rank.sharded, rank.compute_bytes, rank.reduce_bytes
    m = rank.cfg.train.micro_batches
    each = m if rank.cfg.train.reduce_each_micro_batch else 1  # reductions of a ZeRO-2/3 unit per step
    for u in sharded.units:
        if u.zero:
            _add(rank, out, u.group, "reduce_scatter", (each if u.zero >= 2 else 1) * r * u.padded)
            if not u.expert and sharded.replicas > 1:
                _add(rank, out, "dp_replicate", "all_reduce", r * u.shard_size)
        else:
            _add(rank, out, u.group, "all_reduce", r * u.padded)
        if u.zero in (1, 2):
            _add(rank, out, u.group, "all_gather", b * u.padded)
        if u.zero == 3:
            once = rank.schedule is not None or u.keep_gathered
            gathers = 1 if once else m * (1 + u.backward_reads_weights)
            _add(rank, out, u.group, "all_gather", gathers * b * u.padded)
    if sharded.tied_across_stages:
        _add(rank, out, "pp_ends", "all_reduce", 4 * sharded.units[0].shard_size)
    partial = sum((end - start) * sharded.splits[n].tp_parts for u in sharded.units
                  for n, start, end, _ in u.segments() if sharded.splits[n].partial_grad)
    _add(rank, out, "tp", "all_reduce", 4 * partial)


def _scalars(rank: Rank, out: Counter) -> None:
    piped = rank.ctx.size("pp") > 1  # the loss's sums carry the count of ranks whose pipeline compute failed
    _add(rank, out, "loss", "all_reduce", (3 if piped else 2) * SCALAR)  # tokens, loss (and failures)
    _add(rank, out, "pp", "all_reduce", 3 * SCALAR)  # loss and failures, gradient norm
    if rank.sharded.zero:
        _add(rank, out, "fsdp", "all_reduce", SCALAR)  # gradient norm
    _add(rank, out, "tp", "all_reduce", SCALAR)
    if rank.cfg.model.moe_experts:
        _add(rank, out, "loss", "all_reduce", SCALAR)  # the MoE losses, as logged
        _add(rank, out, "pp", "all_reduce", SCALAR)  # and summed over the stages
        _add(rank, out, "pp", "all_reduce", SCALAR * rank.cfg.model.moe_experts * len(rank.cfg.model.moe_layers))
        if rank.model.tp.sequence:
            _add(rank, out, "tp", "all_reduce", SCALAR)
        units = [u for u in rank.sharded.units if u.expert]
        if units:  # the experts' gradient norm
            _add(rank, out, "ep", "all_reduce", SCALAR)
            if any(u.zero for u in units):
                _add(rank, out, "edp", "all_reduce", SCALAR)


def _experts(rank: Rank, out: Counter) -> None:
    """Each MoE layer's rows per expert (fp64), summed over the ranks holding the micro-batch's other tokens; under
    ep its all-to-alls: the counts (int64), then the routed rows there and back in forward and in backward. A rank
    sends its own R = T_h * k rows and those its experts received, R when routing is balanced: the ep group's sum
    is exact, each rank's share depends on the routing."""
    e = rank.cfg.model.moe_experts
    rows = rank.routed_rows
    for layer in rank.blocks:
        if rank.moe(layer) is not None:
            _add(rank, out, "loss", "all_reduce", SCALAR * e)
            if rank.model.tp.sequence:
                _add(rank, out, "tp", "all_reduce", SCALAR * e)
            _add(rank, out, "ep", "all_to_all", 8 * e + 4 * rows * rank.cfg.model.dim * rank.compute_bytes)


def _tensor(rank: Rank, out: Counter) -> None:
    """One micro-batch's tp collectives: each block (an MoE layer's experts, whole on every tp rank, send nothing
    over tp: without a shared expert, its attention's half; full recomputation runs its forward's again), the
    embedding lookup and the head with the loss on the stages that hold them."""
    tp, t = rank.model.tp, rank.micro_tokens
    if tp.size == 1:
        return
    a = t * rank.cfg.model.dim * rank.compute_bytes
    whole, parts = block_bytes(a, tp.sequence), []
    for layer in rank.blocks:
        moe = rank.moe(layer)
        parts.append(whole if moe is None or moe.shared is not None else {op: v // 2 for op, v in whole.items()})
    if rank.cfg.model.recompute == "full":  # an MoE layer's MLP is not run again: its attention's half
        for layer in rank.blocks:
            again = block_bytes(a, tp.sequence, forward_only=True)
            parts.append({op: v // 2 for op, v in again.items()} if rank.moe(layer) is not None else again)
    if any(s.embed for s in rank.model.stages):
        parts.append(embedding_bytes(a, tp.sequence))
    if any(s.head for s in rank.model.stages):
        parts.append(head_bytes(a, t, tp.sequence))
    for part in parts:
        for op, v in part.items():
            _add(rank, out, "tp", op, v)


def _context(rank: Rank, out: Counter) -> None:
    cp, cfg = rank.model.cp, rank.cfg
    if cp.size == 1 or not rank.blocks:
        return
    attn = next(iter(rank.model.layers.values())).attn
    sequences = cfg.train.global_batch // rank.ctx.size("batch") // cfg.train.micro_batches
    shape = (sequences, attn.n_heads, attn.n_kv_heads, cfg.train.seq_len // cp.size, cfg.model.head_dim,
             rank.compute_bytes)
    parts = [cp.comm_bytes(*shape)]
    if cfg.model.recompute != "none":  # both modes run attention's forward again
        again = cp.comm_bytes(*shape, forward_only=True)
        if cfg.model.recompute == "selective" and cp.mode == "ulysses":  # but for the output's all-to-all, which
            # comes after the core's last saved tensor: the recomputation stops before it (torch's early stop)
            again["all_to_all"] -= sequences * attn.n_heads * shape[3] * cfg.model.head_dim * rank.compute_bytes
        parts.append(again)
    for part in parts:
        for op, v in part.items():
            _add(rank, out, "cp", op, len(rank.blocks) * v)


def _pipeline(rank: Rank, out: Counter) -> None:
    if rank.schedule is None:
        return
    sends = sum(a.kind in (SEND_F, SEND_B) for a in rank.schedule.ranks[rank.ctx.rank_in("pp")])
    _add(rank, out, "pp", "send_recv", sends * rank.hidden_tokens * rank.cfg.model.dim * rank.compute_bytes)
