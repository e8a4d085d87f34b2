"""Tensor parallelism (Megatron-style): column/row-parallel linear, vocab-parallel embedding and cross-entropy.

Two dual collectives over the tp group do all the work:
  gather   forward of a column-parallel input and backward of a row-parallel output:
           all-gather of the tokens under sequence-TP, otherwise the identity;
  reduce   forward of a row-parallel output and backward of a column-parallel input:
           reduce-scatter of the tokens under sequence-TP, otherwise an all-reduce.
Activations between sub-layers are [tokens, hidden]; under sequence-TP each rank holds a contiguous
1/tp of the tokens, so both collectives work on dim 0 without copies.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..comm import Comm, Pending

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Split:
    """How a parameter's full tensor maps to this rank: cut into `parts` along `dim`, piece `index`.

    `full` is the size along dim, `padded` that size rounded up to a multiple of parts (vocab rows).
    parts < tp means pieces are replicated on tp/parts ranks (norms: parts 1; kv heads fewer than tp).
    `partial_grad`: each of those replicas holds part of the gradient, to be summed over them.
    `group`: the group the pieces are spread over: tp, or ep for experts (which are whole on every tp rank).
    """
    dim: int = 0
    parts: int = 1
    index: int = 0
    full: int = 0
    padded: int = 0
    partial_grad: bool = False
    group: str = "tp"

    @property
    def tp_parts(self) -> int:
        """Into how many pieces the tp group cuts the tensor (1: whole on every tp rank)."""
        return self.parts if self.group == "tp" else 1

    @property
    def tp_index(self) -> int:
        return self.index if self.group == "tp" else 0

    @property
    def size(self) -> int:
        return (self.padded or self.full) // self.parts

    def full_shape(self, local: torch.Size) -> torch.Size:
        if self.parts == 1:
            return local
        shape = list(local)
        shape[self.dim] = self.full
        return torch.Size(shape)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the full tensor (the padding is zeros)."""
        if self.parts == 1:
            return full
        if self.padded > self.full:
            pad = [0, 0] * (full.dim() - 1 - self.dim) + [0, self.padded - self.full]
            full = F.pad(full, pad)
        return full.narrow(self.dim, self.index * self.size, self.size)


class WeightGrads:
    """Weight gradients computed later than input gradients (zero-bubble pipelines' W actions).

    While `defer` is set, linear layers and MoE experts queue their weight-gradient work here (with the output
    gradient and input it needs, held until then); run() performs it, accumulating into each weight's .grad and
    then calling on_grad(weight). The head's (the logits' linear) only with `head` set too: its output gradient is
    logits-sized. `used`: some backward may defer, so every linear layer runs through the Function that can
    (autograd's own linear cannot).
    """

    def __init__(self):
        self.defer = self.head = self.used = False
        self.pending: list = []
        self.on_grad = None

    def take(self) -> list:
        """The queued work, which run() performs later; the queue is left empty."""
        work, self.pending = self.pending, []
        return work

    @torch.no_grad()
    def run(self, work: list | None = None) -> None:
        """Perform `work` (by default everything queued), emptying the list: each item, with the output gradient
        and input it holds, is dropped before the next item's product is made."""
        work = self.take() if work is None else work
        while work:
            weights, compute = work.pop(0)
            self.accumulate(weights, compute())

    def accumulate(self, weights, grads) -> None:
        """Into each weight's .grad (grads None: the work added them itself), then on_grad; the product is freed on
        return, before the next one is made."""
        for i, weight in enumerate(weights):
            if grads is not None:
                if weight.grad is None:
                    weight.grad = grads[i]
                else:
                    weight.grad.add_(grads[i])
            if self.on_grad is not None:
                self.on_grad(weight)


class TensorParallel:
    """This rank's place in the tp group, and the collectives its layers use."""

    def __init__(self, comm: Comm | None = None, sequence: bool = False):
        self.comm = comm
        self.size = comm.ctx.size("tp") if comm is not None else 1
        self.rank = comm.ctx.rank_in("tp") if comm is not None else 0
        self.sequence = sequence and self.size > 1
        self.weight_grads = WeightGrads()

    def split(self, dim: int, full: int, parts: int | None = None, pad: bool = False,
              partial_grad: bool = False) -> Split:
        """A split of `full` along `dim` into `parts` (default tp) pieces, this rank's piece chosen by its tp rank."""
        parts = self.size if parts is None else parts
        if parts == 1:
            return Split(partial_grad=partial_grad and self.size > 1)
        padded = -(-full // parts) * parts if pad else 0
        return Split(dim, parts, self.rank * parts // self.size, full, padded, partial_grad)

    def uses_sequence(self, tokens: int) -> bool:
        """Sequence-TP applies when the tokens split evenly (generation's single tokens run without it)."""
        return self.sequence and tokens % self.size == 0

    def gather(self, x: torch.Tensor, sp: bool, async_op: bool = False) -> tuple[torch.Tensor, Pending | None]:
        """All-gather of the tokens under sequence-TP; otherwise x itself."""
        if not sp:
            return x, None
        full = x.new_empty((x.shape[0] * self.size, *x.shape[1:]))
        return full, self.comm.all_gather(full, x.contiguous(), "tp", async_op, label="tokens")

    def all_reduce(self, x: torch.Tensor, label: str, op=dist.ReduceOp.SUM) -> None:
        """x summed (or `op`) over tp in place; nothing at tp 1 (a model built alone has no comm)."""
        if self.size > 1:
            self.comm.all_reduce(x, "tp", label=label, op=op)

    def reduce(self, x: torch.Tensor, sp: bool, async_op: bool = False) -> tuple[torch.Tensor, Pending | None]:
        """Reduce-scatter of the tokens under sequence-TP; otherwise an all-reduce (x itself, in place)."""
        if self.size == 1:
            return x, None
        if not sp:
            return x, self.comm.all_reduce(x, "tp", async_op, label="activations")
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        return out, self.comm.reduce_scatter(out, x.contiguous(), "tp", async_op, label="tokens")


def _wait(p: Pending | None) -> None:
    if p is not None:
        p.wait()


class Again(NamedTuple):
    """A linear layer's input as fn(*tensors), computed again in its backward: the tensors are saved in its place
    (model/fused.py: the norm's input and statistics, SwiGLU's input, which their own backward saves anyway)."""
    fn: Callable[..., torch.Tensor]
    tensors: tuple[torch.Tensor, ...]


class _Linear(torch.autograd.Function):
    """y = x [W_1; W_2; ...]^T: weights sharing one input, stacked by rows into one product; column mode gathers
    x, row mode reduces y. With `again` (fn of the first `kept` tensors, the weights after them) x is not saved but
    computed again in backward."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel, mode: str, sp: bool, head: bool, laid_out: bool, again, kept: int,
                *tensors):
        weights = tensors[kept:]
        # the weights themselves, not saved copies: deferred gradients and their hooks need the parameters
        ctx.tp, ctx.mode, ctx.sp, ctx.head, ctx.laid_out, ctx.weights = tp, mode, sp, head, laid_out, weights
        ctx.again, ctx.kept = again, kept
        ctx.save_for_backward(*(tensors[:kept] if again else (x,)))  # under sequence-TP x is the shard
        full = tp.gather(x, sp)[0] if mode == "column" else x
        y = F.linear(full, _stacked(weights, laid_out))
        if mode == "row":
            y, _ = tp.reduce(y, sp)
        return y

    @staticmethod
    def backward(ctx, dy):
        tp, mode, sp = ctx.tp, ctx.mode, ctx.sp
        weights = ctx.weights
        x = ctx.again(*ctx.saved_tensors) if ctx.again else ctx.saved_tensors[0]
        if mode == "column":  # x gathered again under sequence-TP
            full, gathering = tp.gather(x, sp, async_op=True)
            # overlaps the weight gradients
            dx, reducing = tp.reduce(dy @ _stacked(weights, ctx.laid_out), sp, async_op=True)
            _wait(gathering)
        else:
            full = x
            if mode == "row":
                dy, _ = tp.gather(dy, sp)
            dx, reducing = dy @ _stacked(weights, ctx.laid_out), None
        dws = _weight_grads(tp, weights, dy, full, ctx.head)
        _wait(reducing)
        return (dx, None, None, None, None, None, None, None, *[None] * ctx.kept, *dws)


def _stacked(weights: tuple[torch.Tensor, ...], laid_out: bool) -> torch.Tensor:
    """The weights stacked by rows: a view where they lie one after another in one storage (a unit's flat buffer
    lays a module's weights out in order), else a copy. torch.compile cannot check storage offsets: under it the
    caller's laid_out (see note_laid_out) decides."""
    first = weights[0]
    if len(weights) == 1:
        return first
    if laid_out if torch.compiler.is_compiling() else _adjacent(weights):
        return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))
    return torch.cat(weights)


def _adjacent(weights: tuple[torch.Tensor, ...]) -> bool:
    first = weights[0]
    ptr, end = first.untyped_storage().data_ptr(), first.storage_offset()
    for w in weights:
        if not w.is_contiguous() or w.dtype != first.dtype or w.shape[1:] != first.shape[1:] \
                or w.storage_offset() != end or w.untyped_storage().data_ptr() != ptr:
            return False
        end += w.numel()
    return True


def note_laid_out(model: nn.Module) -> None:
    """Set `laid_out` on each module with stacked weights (its `stacked()`): whether they lie one after another
    in one storage, as the unit's flat buffer lays them out. A compiled block trusts it (torch.compile cannot check
    storage offsets): whatever points a parameter's data elsewhere must call this again."""
    for m in model.modules():
        if hasattr(m, "stacked"):
            m.laid_out = _adjacent(tuple(m.stacked()))


def _weight_grads(tp: TensorParallel, weights: tuple[torch.Tensor, ...], dy: torch.Tensor, x: torch.Tensor,
                  head: bool):
    def compute():
        return (dy.flatten(0, -2).t() @ x.flatten(0, -2)).split([w.shape[0] for w in weights])

    wg = tp.weight_grads
    if wg.defer and (wg.head or not head):
        wg.pending.append((weights, compute))
        return [None] * len(weights)
    return compute()


def linear(tp: TensorParallel, x: torch.Tensor, weights: list[torch.Tensor], mode: str, sp: bool,
           head: bool = False, laid_out: bool = False, again: Again | None = None) -> torch.Tensor:
    """x times the weights stacked by rows, in `mode` (plain, column or row): one product whose last dimension
    holds each weight's outputs in turn (the caller splits it; a split, not slices, keeps its gradient one
    tensor). head: the logits' linear (WeightGrads defers it only with `head` set). laid_out: the weights lie
    one after another in one storage (note_laid_out). again: how backward computes x again, rather than save it."""
    wg = tp.weight_grads
    may_defer = wg.defer or wg.used
    if len(weights) == 1 and again is None and not may_defer and (tp.size == 1 or mode == "plain"):
        return F.linear(x, weights[0])  # autograd's own linear suffices
    # torch.compile, if loaded, may be tracing: its backward graph would read weight_grads.defer once, at tracing,
    # and never defer, and it cannot trace the collectives (their ledger, timing and roll call); kept out of its
    # graphs, the Function runs them, and its backward reads `defer` when it runs
    outside = may_defer or (tp.size > 1 and mode != "plain")
    if not outside and not torch.is_grad_enabled():  # (traced by torch.compile, the Function breaks its graph)
        return F.linear(x, _stacked(weights, laid_out))
    apply = outside_compile() if outside and "torch._dynamo" in sys.modules else _Linear.apply
    fn, kept = (None, ()) if again is None else again
    return apply(x, tp, mode, sp and tp.size > 1, head, laid_out, fn, len(kept), *kept, *weights)


_DISABLED: list = []  # not functools.cache, whose wrapper torch.compile warns it ignores


def outside_compile():
    """_Linear.apply as torch.compile calls it: outside its graphs (made once torch.compile is loaded: importing
    it costs a tenth of a GB, which a run that does not compile should not pay; and before it traces, which cannot
    trace the making)."""
    if not _DISABLED:
        _DISABLED.append(torch.compiler.disable(_Linear.apply))
    return _DISABLED[0]


class Linear(nn.Module):
    """A bias-free linear layer whose weight is this rank's piece: rows (column mode) or columns (row mode)."""

    def __init__(self, tp: TensorParallel, in_features: int, out_features: int, mode: str = "plain",
                 split: Split | None = None):
        super().__init__()
        self.tp, self.mode = tp, mode
        if split is None:
            split = tp.split(0, out_features) if mode == "column" else tp.split(1, in_features) if mode == "row" \
                else Split()
        self.split = split
        shape = [out_features, in_features]
        if split.parts > 1:
            shape[split.dim] = split.size
        self.weight = nn.Parameter(torch.empty(shape))

    def forward(self, x: torch.Tensor, sp: bool, again: Again | None = None) -> torch.Tensor:
        return linear(self.tp, x, [self.weight], self.mode, sp, again=again)


class _Reduce(torch.autograd.Function):
    """Forward: the reduce collective (partial sums become whole); backward: its dual, gather."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel, sp: bool):
        ctx.tp, ctx.sp = tp, sp
        return tp.reduce(x, sp)[0]

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.gather(grad, ctx.sp)[0], None, None


class VocabEmbedding(nn.Module):
    """Embedding rows split over tp by vocabulary (padded to a multiple of tp); the lookups are summed."""

    def __init__(self, tp: TensorParallel, vocab_size: int, dim: int):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.split = tp.split(0, vocab_size, pad=True)
        self.weight = nn.Parameter(torch.empty(self.split.size if self.split.parts > 1 else vocab_size, dim))

    @property
    def first(self) -> int:
        return self.split.index * self.split.size

    def forward(self, tokens: torch.Tensor, sp: bool) -> torch.Tensor:
        """[tokens] -> [tokens, dim] (this rank's 1/tp of the tokens under sequence-TP)."""
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0.0)
        return _Reduce.apply(x, self.tp, sp)


class _CrossEntropy(torch.autograd.Function):
    """Token losses from logits split over tp by vocabulary (whole at tp 1), without gathering them. The
    probabilities it saves are the one buffer of logits' size it makes (in the fp32 copy of bf16 logits, in place),
    and its backward turns them into the logits' gradient in place: 4 bytes a logit where F.cross_entropy's backward
    holds 12 (its saved log-probabilities, and their gradient and nll's, each fp32)."""

    @staticmethod
    def forward(ctx, logits, labels, tp: TensorParallel, first: int, vocab_size: int):
        x = logits.float()
        if first + x.shape[1] > vocab_size:  # padded rows (a piece past the vocabulary's end: all of them)
            x = x.clone() if x is logits else x
            x[:, max(vocab_size - first, 0):] = float("-inf")
        top = x.amax(dim=1)  # (max(dim).values finds the indices too: 10 times slower on CPU)
        tp.all_reduce(top, "loss max", dist.ReduceOp.MAX)
        local = labels - first
        mine = (local >= 0) & (local < x.shape[1])
        picked = torch.where(mine, x.gather(1, local.clamp(0, x.shape[1] - 1)[:, None])[:, 0], 0.0)
        exp = (x if x is not logits else x.clone()).sub_(top[:, None]).exp_()
        sums = torch.stack([exp.sum(dim=1), picked])
        tp.all_reduce(sums, "loss sums")
        loss = sums[0].log() + top - sums[1]
        ignored = labels == IGNORE_INDEX
        loss = loss.masked_fill(ignored, 0.0)
        exp.div_(sums[0][:, None])
        ctx.save_for_backward(exp, local, mine & ~ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad):
        """softmax minus the one-hot target, scaled by each token's gradient, in the saved probabilities' buffer
        (a second backward through a kept graph fails autograd's check of a saved tensor modified in place)."""
        probs, local, mine, ignored = ctx.saved_tensors
        grad = grad.masked_fill(ignored, 0.0)
        dlogits = probs.mul_(grad[:, None])
        dlogits.scatter_add_(1, local.clamp(0, probs.shape[1] - 1)[:, None], -(grad * mine)[:, None])
        return dlogits, None, None, None, None


def cross_entropy(tp: TensorParallel, logits: torch.Tensor, labels: torch.Tensor, first: int,
                  vocab_size: int) -> torch.Tensor:
    """Sum of token cross-entropies in fp32; logits [tokens, this rank's vocab piece starting at `first`]."""
    return _CrossEntropy.apply(logits, labels, tp, first, vocab_size).sum()


@torch.no_grad()
def gather_vocab(tp: TensorParallel, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full logits [tokens, vocab] from every rank's vocab piece (generation only: no gradient)."""
    if tp.size == 1:
        return logits
    pieces = logits.new_empty((tp.size * logits.shape[0], logits.shape[1]))
    tp.comm.all_gather(pieces, logits.contiguous(), "tp", label="logits")
    return pieces.view(tp.size, *logits.shape).permute(1, 0, 2).flatten(1)[:, :vocab_size]


def block_bytes(a: int, sequence: bool, forward_only: bool = False) -> dict[str, int]:
    """Bytes over the tp group for one block's forward and backward, a = tokens * dim * itemsize (all-gathers
    count their output, reduce-scatters their input): without sequence-TP, 4 all-reduces of a (after wo and
    w_down forward, before qkv and gate/up backward); with it, the same volume as 2 all-gathers and 2
    reduce-scatters each way, plus 2 all-gathers in backward that gather the qkv and gate/up inputs again
    (only shards are saved). With `forward_only`, the forward's part (what full recomputation runs again)."""
    if forward_only:
        return {"all_gather": 2 * a, "reduce_scatter": 2 * a} if sequence else {"all_reduce": 2 * a}
    return {"all_gather": 6 * a, "reduce_scatter": 4 * a} if sequence else {"all_reduce": 4 * a}


def embedding_bytes(a: int, sequence: bool) -> dict[str, int]:
    """The vocab-parallel lookup's reduce (a reduce-scatter under sequence-TP) and its dual in backward."""
    return {"reduce_scatter": a, "all_gather": a} if sequence else {"all_reduce": a}


def head_bytes(a: int, tokens: int, sequence: bool) -> dict[str, int]:
    """The column-parallel head's collectives, and the vocab-parallel loss's all-reduce of 3 fp32 per token
    (max, sum of exponentials, target logit)."""
    loss = 3 * tokens * 4
    return {"all_gather": 2 * a, "reduce_scatter": a, "all_reduce": loss} if sequence else {"all_reduce": a + loss}


def comm_bytes(n_layers: int, tokens: int, dim: int, tp: int, sequence: bool, itemsize: int = 4) -> dict[str, int]:
    """Bytes over the tp group for one forward and backward of the whole model on `tokens` tokens, by op."""
    if tp == 1:
        return {}
    a, out = tokens * dim * itemsize, {}
    parts = [embedding_bytes(a, sequence), head_bytes(a, tokens, sequence)] + [block_bytes(a, sequence)] * n_layers
    for part in parts:
        for op, v in part.items():
            out[op] = out.get(op, 0) + v
    return out
