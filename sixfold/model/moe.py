"""Mixture of experts: a top-k softmax router (weights renormalised over the k as in Mixtral, or as routed as in
Switch), SwiGLU experts run grouped per rank, an optional shared expert, and dropless dispatch (every token
reaches its k experts; nothing depends on how tokens split).

The load-balancing loss (Switch / Mixtral: E * sum_e f_e * P_e) takes its expert counts f over all the tokens
of the step's micro-batch on every data, context (and, under sequence-TP, tensor) parallel rank, so with one
micro-batch it is the single-process value in every layout; each micro-batch counts 1/micro_batches. It and
the router z-loss enter backward where the layer's output is (their gradient is added there), so pipeline
stages need not carry them to the loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..config import ModelConfig
from ..parallel.expert import ExpertParallel
from ..parallel.tensor import Split, TensorParallel, WeightGrads


def routing_warning(cfg: ModelConfig) -> str:
    """What to tell a user about to train this model's routing, or ""."""
    if cfg.moe_experts and cfg.moe_top_k == 1 and cfg.moe_norm_topk:
        return ("model.moe_top_k=1 with model.moe_norm_topk=true gives every token the weight 1, so the router "
                "learns from the balancing loss only; set model.moe_norm_topk=false (Switch-style: the weight is "
                "the router's probability) to train it on the language-model loss too")
    return ""


class _WithLoss(torch.autograd.Function):
    """Identity on x whose backward also gives `loss` the gradient 1, as if it were added to the training loss."""

    @staticmethod
    def forward(ctx, x, loss):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.split = Split(partial_grad=tp.sequence)  # whole on every tp rank; its tokens differ under sequence-TP
        self.weight = nn.Parameter(torch.empty(cfg.moe_experts, cfg.dim))


class Experts(nn.Module):
    """This ep rank's experts, whole on every tp rank: weights [local experts, out, in]."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ep: ExpertParallel):
        super().__init__()
        n, local = cfg.moe_experts, cfg.moe_experts // ep.size
        self.tp = tp
        self.split = Split(0, ep.size, ep.rank, n, partial_grad=tp.sequence, group="ep") if ep.size > 1 else \
            Split(partial_grad=tp.sequence)
        self.w_gate = nn.Parameter(torch.empty(local, cfg.ffn_dim, cfg.dim))
        self.w_up = nn.Parameter(torch.empty(local, cfg.ffn_dim, cfg.dim))
        self.w_down = nn.Parameter(torch.empty(local, cfg.dim, cfg.ffn_dim))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [n, dim] sorted by local expert, counts[j] of them for expert j."""
        return _Grouped.apply(rows, counts, self.tp.weight_grads, self.w_gate, self.w_up, self.w_down)


def _spans(counts: list[int]):
    start = 0
    for j, n in enumerate(counts):
        yield j, slice(start, start + n)
        start += n


class _Grouped(torch.autograd.Function):
    """Each local expert's SwiGLU MLP on its rows. Saves the rows and each row's [gate | up] product; silu(gate) * up
    is made again in backward. Backward adds each expert's weight gradients into its slice of the weights' .grad
    (while weight_grads defers them, in its W, which then tells weight_grads.on_grad), as the deferred linear
    layers do, whatever inputs the caller asked gradients for: autograd would keep every expert's gradient until
    the last one's and then stack them into a new tensor. The weights' post-accumulate hooks still run after it
    (autograd runs them for a None gradient too)."""

    @staticmethod
    def forward(ctx, rows, counts: list[int], weight_grads: WeightGrads, w_gate, w_up, w_down):
        f = w_gate.shape[1]
        gate_up = rows.new_empty(rows.shape[0], 2 * f)
        out = rows.new_empty(rows.shape[0], w_down.shape[1])
        for j, s in _spans(counts):
            torch.mm(rows[s], w_gate[j].t(), out=gate_up[s, :f])
            torch.mm(rows[s], w_up[j].t(), out=gate_up[s, f:])
            torch.mm(F.silu(gate_up[s, :f]).mul_(gate_up[s, f:]), w_down[j].t(), out=out[s])
        ctx.save_for_backward(rows, gate_up)
        ctx.counts, ctx.weight_grads, ctx.weights = counts, weight_grads, (w_gate, w_up, w_down)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        rows, gate_up = ctx.saved_tensors
        w_gate, w_up, w_down = ctx.weights
        # the weights that want a gradient (a frozen one gets none)
        gate_w, up_w, down_w = (w if need else None for w, need in zip(ctx.weights, ctx.needs_input_grad[3:]))
        defer = ctx.weight_grads.defer
        f, drows, later = w_gate.shape[1], torch.empty_like(rows), []
        for j, s in _spans(ctx.counts):
            gate, up, g = gate_up[s, :f], gate_up[s, f:], grad[s]
            silu = F.silu(gate)
            act = silu * up
            if not defer:  # w_down's now: act is freed before the gate's gradient is made
                _add_grad(down_w, j, g, act)
                act = None
            dgate = g @ w_down[j]
            dup = silu.mul_(dgate)
            dgate.mul_(up)
            torch.ops.aten.silu_backward.grad_input(dgate, gate, grad_input=dgate)
            torch.mm(dgate, w_gate[j], out=drows[s]).addmm_(dup, w_up[j])
            if defer:
                later.append((j, rows[s], g, act, dgate, dup))
            else:
                _add_grad(gate_w, j, dgate, rows[s])
                _add_grad(up_w, j, dup, rows[s])
        wanted = tuple(w for w in (gate_w, up_w, down_w) if w is not None)
        if later and wanted:
            ctx.weight_grads.pending.append((wanted, lambda: _add_later((gate_w, up_w, down_w), later)))
        return drows, None, None, None, None, None


def _add_grad(weight, j: int, grad_out, x) -> None:
    """Expert j's gradient of `weight` (None: none wanted), grad_out^T x, added into its slice of weight.grad
    (made, zeros, if none)."""
    if weight is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    weight.grad[j].addmm_(grad_out.t(), x)


def _add_later(weights, pieces: list) -> None:
    """A deferred backward's weight gradients, expert by expert, each expert's tensors dropped once used
    (WeightGrads.run then tells on_grad)."""
    gate_w, up_w, down_w = weights
    while pieces:
        j, rows, g, act, dgate, dup = pieces.pop(0)
        _add_grad(down_w, j, g, act)
        _add_grad(gate_w, j, dgate, rows)
        _add_grad(up_w, j, dup, rows)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, ep: ExpertParallel, shared: nn.Module | None):
        super().__init__()
        self.cfg, self.tp, self.ep = cfg, tp, ep
        self.router = Router(cfg, tp)
        self.experts = Experts(cfg, tp, ep)
        self.shared = shared
        self.micro_batches = 1  # set by the trainer: each micro-batch's balancing loss counts 1/micro_batches
        self.counts = torch.zeros(cfg.moe_experts, dtype=torch.float64)  # rows per expert since the last read
        self.aux = torch.zeros((), dtype=torch.float64)  # balancing + z-loss since the last read

    def _global(self, counts: torch.Tensor, sp: bool) -> torch.Tensor:
        """Rows per expert over every rank holding other tokens of this micro-batch."""
        counts = counts.to(torch.float64)
        if self.tp.comm is not None:
            self.tp.comm.all_reduce(counts, "loss", label="expert counts")
            if sp:
                self.tp.comm.all_reduce(counts, "tp", label="expert counts")
        return counts

    def forward(self, x: torch.Tensor, sp: bool) -> torch.Tensor:
        """x [tokens, dim] -> [tokens, dim]."""
        cfg, k = self.cfg, self.cfg.moe_top_k
        logits = F.linear(x, self.router.weight).float()
        probs = logits.softmax(-1)
        top, chosen = probs.topk(k, dim=-1)
        weights = top / top.sum(-1, keepdim=True) if cfg.moe_norm_topk else top
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # rows sorted by expert
        token = order // k  # the token of each row
        counts = torch.zeros(cfg.moe_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # (bincount would wait for the device to size itself)
        rows, local_counts, back = self.ep.dispatch(x[token], counts)
        out = self.ep.combine(self.experts(rows, local_counts), back)
        y = torch.zeros_like(x).index_add(0, token, out * weights.flatten()[order, None].to(x.dtype))
        if self.shared is not None:
            y = y + self.shared(x, sp)
        if not torch.is_grad_enabled():
            return y
        total = self._global(counts, sp)
        tokens = total.sum() / k  # a tensor: nothing here waits for the device
        share = (total / tokens).to(probs.dtype)  # f: fraction of tokens sent to each expert (sums to k)
        tokens = tokens.to(probs.dtype)
        balance = cfg.moe_experts * (share * probs.sum(0)).sum() / tokens
        z = logits.logsumexp(-1).pow(2).sum() / tokens
        loss = (cfg.moe_aux_weight * balance + cfg.moe_z_weight * z) / self.micro_batches
        self.counts = self.counts.to(total.device) + total
        self.aux = self.aux.to(total.device) + loss.detach()
        return _WithLoss.apply(y, loss)
