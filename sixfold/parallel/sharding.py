"""Flat buffers per FSDP unit; data-parallel gradient reduction and ZeRO-1/2/3 over the fsdp group.

A unit (the embedding, each block, the final norm with the head) owns flat buffers, padded so that
every rank's shard is equal and aligned:
  full        compute weights; the parameters are views of it
  grad        full gradients; the parameters' .grad are views of it
  master      this rank's shard of the weights, which the optimizer updates (`full` itself when unsharded)
  grad_shard  this rank's shard of the reduced gradients (`grad` itself when unsharded)
zero 0: each unit's gradients are all-reduced over the loss group as soon as its backward is done on the
last micro-batch (DDP). zero 1: reduce-scattered over fsdp instead; the shard is updated, then the weights
all-gathered, each unit's gather waited for by its next forward. zero 2: also a unit's full gradients exist
only from its backward (the head's and a tied embedding's: from their forward; under pipelining: from the
step's start) until its reduce-scatter is done, with at most REDUCING reductions in flight (so too at any
zero where gradients are reduced through a copy in grad_reduce's dtype, and at ZeRO-1 on CPU, whose
reduce-scatter stages the whole input). Nothing is cast where nothing is sent (a group of one). zero 3: also the
full weights are freed outside the unit's forward and backward and gathered just ahead of use (prefetch); the
head's unit and the one before it stay gathered through the step. The two units the next step begins with are
gathered as soon as the optimizer has updated them, while it updates the rest, and stay gathered until that step
(`ahead`).
Generation (held()) keeps each unit gathered from its first forward to the end, where the whole model fits.
With dp_replicate > 1 (HSDP) each unit's gradient shard is all-reduced across replicas (in grad_reduce's dtype) once
its reduce-scatter is done. At zero 2 and 3 the trainer may also reduce after every micro-batch
(train.reduce_each_micro_batch): each reduction is added into the fp32 shard, the HSDP all-reduce only after the
last, and the full gradients are freed between micro-batches too.
Under tensor parallelism the units hold this tp rank's pieces, laid out alike on every tp rank; parameters
whose replicas over tp each hold part of the gradient (norms under sequence-TP, shared kv heads) are summed
over tp once per step.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import weakref

import torch
from torch import nn

from ..comm import Comm, Pending
from .tensor import Split, VocabEmbedding, note_laid_out

ALIGN = 16  # elements: shard boundaries stay aligned
REDUCING = 2  # reductions in flight before the oldest is waited for and its full gradients (ZeRO-2/3) or copy freed


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> bool:
    """Give a freed buffer its storage back; True if it had been freed."""
    storage = t.untyped_storage()
    if storage.size():
        return False
    storage.resize_(t.numel() * t.element_size())
    return True


class Unit:
    def __init__(self, index: int, modules: list[nn.Module], named: list[tuple[str, nn.Parameter]],
                 shards: int, rank: int, dtype: torch.dtype):
        self.index, self.modules = index, modules
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.sizes = [p.numel() for p in self.params]
        self.offsets = list(itertools.accumulate([0] + self.sizes[:-1]))
        quantum = shards * ALIGN
        self.padded = -(-sum(self.sizes) // quantum) * quantum
        self.shard_size = self.padded // shards
        self.lo = rank * self.shard_size
        exact = self.flatten({n: p.data for n, p in zip(self.names, self.params)})
        self.full = exact if dtype == torch.float32 else exact.to(dtype)
        self.grad = torch.zeros_like(self.full)
        for p, o, n in zip(self.params, self.offsets, self.sizes):
            p.data = self.full[o:o + n].view_as(p)
            p.grad = self.grad[o:o + n].view_as(p)
        own = shards > 1 or dtype != torch.float32  # the fp32 master needs storage of its own
        self.master = exact[self.lo:self.lo + self.shard_size].clone() if own else self.full
        self.grad_shard = torch.zeros_like(self.master) if own else self.grad
        # this rank's shard in the compute dtype, the input of gathers; unsharded, the compute weights themselves
        self.compute_shard = self.master if dtype == torch.float32 else self.full if shards == 1 else \
            self.master.to(dtype)
        self.ready = 0
        self.reduce: Pending | None = None
        self.replicate: Pending | None = None  # HSDP: the all-reduce of the reduced shard across replicas
        self.gather: Pending | None = None
        self.keep_gathered = False
        self.grad_at_forward = True
        self.read_elsewhere = False
        self.backward_reads_weights = True
        self.reduced: torch.Tensor | None = None  # where the step's reduction puts its result, once launched
        self.completed = False  # that reduction waited for and its result in grad_shard
        self.final = False  # that reduction is the step's last (after the last micro-batch)
        self.accumulated = False  # grad_shard holds the sum of earlier micro-batches' reductions this step

    @property
    def gathers_for_backward(self) -> bool:
        """ZeRO-3 with weights that the backward reads: gathered again before it."""
        return self.zero == 3 and self.backward_reads_weights

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter views of a full-size flat tensor laid out like this unit."""
        return {n: flat[o:o + s].view_as(p) for n, p, o, s in zip(self.names, self.params, self.offsets, self.sizes)}

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The fp32 unit-shaped flat tensor of named tensors (zeros in the padding)."""
        flat = torch.zeros(self.padded, dtype=torch.float32, device=self.params[0].device)
        for n, o, s in zip(self.names, self.offsets, self.sizes):
            flat[o:o + s].copy_(tensors[n].flatten())
        return flat

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a unit-shaped flat tensor (all of it when unsharded)."""
        return flat[self.lo:self.lo + self.shard_size]

    def segments(self) -> list[tuple[str, int, int, int]]:
        """(name, start, end, offset) of each parameter's part inside this rank's shard: start and end in shard
        coordinates, offset where the part begins in the flattened parameter."""
        out = []
        hi = self.lo + self.shard_size
        for n, o, s in zip(self.names, self.offsets, self.sizes):
            a, b = max(o, self.lo), min(o + s, hi)
            if a < b:
                out.append((n, a - self.lo, b - self.lo, a - o))
        return out


def unit_modules(model: nn.Module) -> list[tuple[list[nn.Module], bool]]:
    """The modules of each unit, and whether it holds experts: the embedding, each block (its experts in a unit
    of their own, after it), and the final norm with the head (a tied head adds no parameter); those of them
    that this rank's pipeline stages hold."""
    units = [([model.embed], False)] if model.embed is not None else []
    for block in model.layers.values():
        units.append(([block], False))
        if hasattr(block.mlp, "experts"):
            units.append(([block.mlp.experts], True))
    if model.norm is not None:
        units.append(([model.norm] + ([model.head] if model.head is not None else []), False))
    return units


def unit_params(model: nn.Module) -> list[tuple[list[nn.Module], list[tuple[str, nn.Parameter]], bool]]:
    """Each unit's modules, its parameters by global name (each parameter in one unit; experts in theirs), and
    whether it holds experts."""
    names = {id(p): n for n, p in model.named_parameters()}
    plan = unit_modules(model)
    experts = {id(p) for modules, expert in plan if expert for m in modules for p in m.parameters()}
    return [(modules, [(names.pop(id(p)), p) for m in modules for p in m.parameters()
                       if id(p) in names and (expert or id(p) not in experts)], expert) for modules, expert in plan]


class _BeforeBackward(torch.autograd.Function):
    """Identity on a unit's output whose backward readies the unit (its gradient buffer, its gathered weights)
    before its own backward runs."""

    @staticmethod
    def forward(ctx, sharded, unit, x):
        ctx.sharded, ctx.unit = sharded, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.sharded.before_backward(ctx.unit)
        return None, None, grad


class Sharded:
    """The model's parameters in units, reduced and (for zero >= 1) sharded over the fsdp group."""

    def __init__(self, model: nn.Module, comm: Comm, zero: int, reshard_after_forward: bool = True,
                 dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype = torch.float32):
        self.comm, self.reduce_dtype = comm, reduce_dtype
        ctx = comm.ctx
        self.zero = zero if ctx.size("fsdp") > 1 else 0
        self.replicas = ctx.size("dp_replicate") if self.zero else 1
        self.units = []
        for i, (modules, named, expert) in enumerate(unit_params(model)):
            # experts are sharded and reduced over edp (the ep group holds different experts), the rest over fsdp
            group = "edp" if expert else "fsdp"
            shards = ctx.size(group) if self.zero else 1
            unit = Unit(i, modules, named, shards, ctx.rank_in(group) if shards > 1 else 0, dtype)
            unit.expert, unit.zero = expert, self.zero if shards > 1 else 0
            unit.group = group if unit.zero else "edp" if expert else "loss"
            self.units.append(unit)
        note_laid_out(model)
        # the units by layer, in the order the backward reaches them: from the last, a block before its experts (the
        # layer's output comes through the block). ZeRO-3 prefetches the next layer's weights as a layer's backward
        # begins; in an MoE layer its block's once the experts' backward is done (their weights freed): the experts
        # are the larger, gathered behind the whole layer, the block behind the rest of it
        self.layers: list[list[Unit]] = []
        for unit in reversed(self.units):
            if not unit.expert and self.layers and self.layers[-1][0].expert and len(self.layers[-1]) == 1:
                self.layers[-1].insert(0, unit)
            else:
                self.layers.append([unit])
        self.prefetch, self.prefetch_after = {}, {}
        for layer, after in zip(self.layers, self.layers[1:]):
            staggered = len(layer) > 1 and layer[-1].zero == 3  # (experts not sharded: nothing to free first)
            self.prefetch[layer[0].index] = after[1:] if staggered else after
            self.prefetch_after[layer[-1].index] = after[:1] if staggered else []
        # the layer whose backward follows the head's at once (the head has no hook to prefetch it by)
        after_head = {u.index for u in self.layers[1]} if model.norm is not None and len(self.layers) > 1 else set()
        self._due: list[Unit] = []  # reduce_when_done
        self._final = True  # the reductions it starts are the step's last
        self._done: set[int] = set()
        self._reducing: list[Unit] = []
        self.tp, self.splits = model.tp, model.splits()
        self.tied_across_stages = model.tied_across_stages
        # this rank holds the tied embedding for the head only: a copy of the first stage's
        self.embed_copy = model.tied_across_stages and model.norm is not None
        unit_of = {id(p): u for u in self.units for p in u.params}
        model.tp.weight_grads.on_grad = lambda p: self._on_grad(unit_of[id(p)])
        tied = model.head is None
        # a tensor's hooks are out of the garbage collector's sight: a hook holding this object or a unit would keep
        # them, the model and its process groups alive for the life of the process
        me = weakref.ref(self)
        for unit in self.units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, i=unit.index: me()._on_grad(me().units[i]))
            # the last unit's backward follows its forward at once; a tied embedding serves the head too
            last, tied_embedding = unit.index == len(self.units) - 1, tied and unit.modules[0] is model.embed
            if unit.zero >= 2:
                # gradients that arrive before the unit's own backward (the head's, into a tied embedding) need
                # the buffer from the forward on
                unit.grad_at_forward = last or tied_embedding
                if unit.grad_at_forward:
                    unit.modules[0].register_forward_pre_hook(lambda m, a, u=unit: self._grad_buffer(u))
                unit.modules[-1].register_forward_hook(lambda m, a, out, u=unit: self._after_forward(u, out))
                _free(unit.grad)
            if unit.zero:
                unit.read_elsewhere = tied_embedding  # by the head, not through its own module's forward
            if unit.zero in (1, 2):  # the gather after a step, waited for by the unit's next forward
                unit.modules[0].register_forward_pre_hook(lambda m, a, u=unit: self._end_gather(u))
            if unit.zero == 3:
                # freed after its forward, the last layer would be gathered again at once for its backward
                unit.keep_gathered = not reshard_after_forward or last or unit.index in after_head or tied_embedding
                unit.backward_reads_weights = not all(isinstance(m, VocabEmbedding) for m in unit.modules)
                unit.modules[0].register_forward_pre_hook(lambda m, a, u=unit: self.before_forward(u))
                _free(unit.full)
        self.ahead = [u for u in self.units if u.zero == 3][:2]  # ZeRO-3: the units a step's forward begins with
        self.holding = False  # held(): forwards without gradients keep the weights they gather

    # ZeRO-3: weights gathered just ahead of use -------------------------------------------------
    def _start_gather(self, unit: Unit) -> None:
        if unit.gather is None and _alloc(unit.full):
            unit.gather = self.comm.all_gather(unit.full, unit.compute_shard, unit.group, async_op=True,
                                               label=f"unit {unit.index}")

    def _wait_gather(self, unit: Unit) -> None:
        self._start_gather(unit)
        self._end_gather(unit)

    @staticmethod
    def _end_gather(unit: Unit) -> None:
        """Wait for the unit's gather in flight, if any."""
        if unit.gather is not None:
            unit.gather.wait()
            unit.gather = None

    def gather_all(self) -> None:
        """ZeRO-3: every unit's weights gathered for the step (pipelining keeps them): all started now, each waited
        for by its first forward, a unit read outside its module's forward here."""
        for unit in self.units:
            if unit.zero == 3:
                self._start_gather(unit)
        for unit in self.units:
            if unit.read_elsewhere:
                self._wait_gather(unit)

    @contextlib.contextmanager
    def held(self):
        """ZeRO-3, for forwards without gradients inside (generation): each unit's weights gathered once, by its first
        forward, and all freed at the end, not after each forward (a sample of n tokens would gather the whole model
        n times), if the whole model's gathered weights fit in the free memory of every rank's device; else each
        forward gathers them again. Yields whether they are held."""
        loose = sum(u.full.numel() * u.full.element_size() for u in self.units
                    if u.zero == 3 and not u.full.untyped_storage().size())
        self.holding = self._fits(loose)
        try:
            yield self.holding
        finally:
            self.holding = False
            self.release()

    def _fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit in the free memory of every rank's device (on CPUs: taken to)."""
        device = self.comm.ctx.device
        if self.zero != 3 or device.type != "cuda":  # (alike on every rank: each takes part in the sum or none)
            return True
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
            torch.cuda.memory_allocated(device)
        (short,) = self.comm.sum_scalars([float(nbytes > free)], "world")
        return not short

    def alloc_grads(self) -> None:
        """ZeRO-2/3: every unit's gradient buffer ready now (pipelining: for the step)."""
        for unit in self.units:
            self._grad_buffer(unit)

    def before_forward(self, unit: Unit) -> None:
        """The next unit's gather starts before this one's is waited for (at the step's start both are in flight)."""
        self._start_gather(unit)
        if unit.index + 1 < len(self.units):
            self._start_gather(self.units[unit.index + 1])
        self._end_gather(unit)

    def _after_forward(self, unit: Unit, out):
        if not torch.is_grad_enabled():  # evaluation: no backward to keep weights for (release() frees the rest)
            if unit.zero == 3 and not unit.read_elsewhere and not self.holding:
                _free(unit.full)
            return out
        if unit.zero == 3 and not unit.keep_gathered:
            _free(unit.full)
        ready = unit.gathers_for_backward or not unit.grad_at_forward
        return _BeforeBackward.apply(self, unit, out) if ready else out

    def before_backward(self, unit: Unit) -> None:
        self._alloc_grad(unit)
        if not unit.gathers_for_backward:
            return
        self._wait_gather(unit)
        self._prefetch(self.prefetch.get(unit.index, []))

    def _prefetch(self, units: list[Unit]) -> None:
        """ZeRO-3: the gathers started of those of `units` whose backward reads their weights."""
        for unit in units:
            if unit.gathers_for_backward:
                self._start_gather(unit)

    # gradients ----------------------------------------------------------------------------------
    def _grad_buffer(self, unit: Unit) -> None:
        if torch.is_grad_enabled():
            self._alloc_grad(unit)

    @staticmethod
    def _alloc_grad(unit: Unit) -> None:
        if _alloc(unit.grad):
            unit.grad.zero_()

    def _on_grad(self, unit: Unit) -> None:
        """A parameter's gradient is accumulated; when the whole unit's are, its backward is done."""
        unit.ready += 1
        if unit.ready >= len(unit.params):
            self._unit_done(unit)

    def _unit_done(self, unit: Unit) -> None:
        unit.ready = 0
        if unit.zero == 3 and not unit.keep_gathered:
            _free(unit.full)
        self._prefetch(self.prefetch_after.get(unit.index, []))
        if unit in self._due:
            self._done.add(unit.index)
            while self._due and self._due[0].index in self._done:
                self.launch(self._due.pop(0))

    def reduce_when_done(self, units, reports: set[int] | None = None, last: bool = True) -> None:
        """The units whose gradients for the step complete in the backward (or weight-gradient action) about to run,
        in the order it completes them: each one's reduction starts once it and those before it are done. Their
        counts start over: earlier actions are finished. `reports`: the ids of the parameters that action reports
        (a W: its deferred weights); a unit's others are done already (None: it reports them all). Not `last`: a
        micro-batch before the last, whose reductions only the units that free their gradients (ZeRO-2/3) make."""
        self._final = last
        self._due, self._done = [u for u in units if last or u.zero >= 2], set()
        for unit in list(self._due):
            unit.ready = 0 if reports is None else sum(id(p) not in reports for p in unit.params)
            if unit.ready >= len(unit.params):
                self._unit_done(unit)

    def reduce_due(self) -> None:
        """After that backward: start the reductions it did not, in order (a parameter it gave no gradient)."""
        while self._due:
            self.launch(self._due.pop(0))

    def end_micro_batch(self) -> None:
        """After a micro-batch before the last whose gradients were reduced (train.reduce_each_micro_batch): every
        reduction started and waited for, so that the next micro-batch begins with no full gradient."""
        self.reduce_due()
        for unit in self._reducing:
            self._complete(unit)
        self._reducing = []

    def launch(self, unit: Unit) -> None:
        """Start the unit's reduction (in reduce_dtype when anything is sent), once its gradients for the step are
        complete; in the same unit order on every rank of the group."""
        self._alloc_grad(unit)  # (freed, if the step gave it no gradient)
        wire = self.reduce_dtype if self.comm.ctx.size(unit.group) > 1 else unit.grad.dtype
        if unit.zero:
            src = unit.grad.to(wire)  # unit.grad itself in its own dtype
            if wire == unit.grad_shard.dtype:
                if unit.accumulated:  # earlier micro-batches' sum joins the reduction in this rank's own slice
                    unit.shard_of(src).add_(unit.grad_shard)
                out = unit.grad_shard
            else:
                out = torch.empty(unit.shard_size, dtype=wire, device=src.device)
            unit.reduce = self.comm.reduce_scatter(out, src, unit.group, async_op=True, label=f"unit {unit.index}")
        else:
            if unit.grad_shard is not unit.grad and unit.grad_shard.dtype == wire:
                src = out = unit.grad_shard.copy_(unit.grad)  # reduce in place in the fp32 shard, no temporary
            else:
                src = out = unit.grad.to(wire)
            unit.reduce = self.comm.all_reduce(out, unit.group, async_op=True, label=f"unit {unit.index}")
        unit.reduced, unit.completed, unit.final = out, False, self._final
        copy = all(src is not t for t in (unit.grad, unit.grad_shard))
        if unit.zero >= 2 or copy or (unit.zero and self.comm.stages_reduce_scatter(src, unit.group)):
            self._reducing.append(unit)  # full gradients, or a copy or staging buffer of them, to free
            if len(self._reducing) > REDUCING:
                self._complete(self._reducing.pop(0))

    def _complete(self, unit: Unit) -> None:
        """Wait for the unit's reduction (none on a group of one), its result into the fp32 shard (added to earlier
        micro-batches' there; a copy in reduce_dtype freed); ZeRO-2/3 free the full gradients. The step's last is
        then all-reduced across replicas (HSDP)."""
        if unit.reduced is None or unit.completed:
            return
        unit.completed = True
        if unit.reduce is not None:
            unit.reduce.wait()
            unit.reduce = None
        if unit.reduced is not unit.grad_shard:
            if unit.accumulated:
                unit.grad_shard.add_(unit.reduced)
            else:
                unit.grad_shard.copy_(unit.reduced)
            unit.reduced = unit.grad_shard
        unit.accumulated = True
        if unit.zero >= 2:
            _free(unit.grad)
        if unit.final and self.replicas > 1 and not unit.expert:  # in reduce_dtype, summed back into the fp32 shard
            shard = unit.grad_shard.to(self.reduce_dtype)
            unit.replicate = self.comm.all_reduce(shard, "dp_replicate", async_op=True, label=f"unit {unit.index}")
            if shard is not unit.grad_shard:
                unit.replicate.then = lambda: unit.grad_shard.copy_(shard)

    def finish(self) -> None:
        """After the last micro-batch's backward: reduce what has not started, wait, then across replicas."""
        self._final = True
        for unit in reversed(self.units):
            if unit.reduced is None or not unit.final:
                self.launch(unit)
        for unit in self.units:
            self._complete(unit)
            unit.reduced, unit.ready, unit.final, unit.accumulated = None, 0, False, False
        self._reducing = []
        for unit in self.units:
            if unit.replicate is not None:
                unit.replicate.wait()
                unit.replicate = None
        if self.tied_across_stages:
            self.comm.all_reduce(self.units[0].grad_shard, "pp_ends", label="tied embedding")
        self._sum_partial_grads()
        self.release()
        self._due = []

    def release(self) -> None:
        """ZeRO-3: every unit's gathered weights freed (a gather in flight waited for first)."""
        for unit in self.units:
            if unit.zero == 3:
                self._end_gather(unit)
                _free(unit.full)

    def _partial_segments(self) -> list[tuple[torch.Tensor, Split]]:
        return [(u.grad_shard[a:b], self.splits[n]) for u in self.units for n, a, b, _ in u.segments()
                if self.splits[n].partial_grad]

    def _sum_partial_grads(self) -> None:
        """Sum over tp the gradients that each replica holds a part of: piece k in slot k of one buffer."""
        segments = self._partial_segments()
        if not segments:
            return
        slots = [(g, s.tp_parts, s.tp_index) for g, s in segments]
        buf = torch.zeros(sum(g.numel() * parts for g, parts, _ in slots), dtype=segments[0][0].dtype,
                          device=segments[0][0].device)
        places, at = [], 0
        for g, parts, index in slots:
            places.append(buf[at + index * g.numel():at + (index + 1) * g.numel()])
            places[-1].copy_(g)
            at += g.numel() * parts
        self.comm.all_reduce(buf, "tp", label="partial grads")
        for (g, _, _), place in zip(slots, places):
            g.copy_(place)

    def grad_norm_sq(self) -> float:
        """Squared L2 norm of the reduced gradients: fp32 per shard (_norm), summed in fp64 over the groups that
        hold different parts (fsdp; ep and edp for experts; tp; pp).

        A piece replicated on several tp ranks counts once: each replica adds its share; so does a tied
        embedding held by the first and last pipeline stages.
        """
        units = self.units[1 if self.embed_copy else 0:]
        replicated = [[(1 - self.splits[n].tp_parts / self.tp.size, u.grad_shard[a:b]) for n, a, b, _ in u.segments()
                       if self.splits[n].tp_parts < self.tp.size] for u in units]
        tensors = [t for u, pieces in zip(units, replicated) for t in (u.grad_shard, *(g for _, g in pieces))]
        norms = iter(map(_norm, tensors, torch.stack([t.norm() for t in tensors]).tolist()))  # one round trip
        dense = experts = 0.0
        for u, pieces in zip(units, replicated):
            sq = next(norms) ** 2
            for share, _ in pieces:
                sq -= share * next(norms) ** 2
            if u.expert:
                experts += sq
            else:
                dense += sq
        if self.zero:
            (dense,) = self.comm.sum_scalars([dense], "fsdp")
        if any(u.expert for u in self.units):
            (experts,) = self.comm.sum_scalars([experts], "ep")
            if any(u.expert and u.zero for u in self.units):
                (experts,) = self.comm.sum_scalars([experts], "edp")
        total = dense + experts
        for group in ("tp", "pp"):
            (total,) = self.comm.sum_scalars([total], group)
        return total

    def publish_all(self) -> None:
        """Every unit's fp32 shard into its compute weights (publish()), the gathers waited for: after a load. ZeRO-3
        first frees what it held gathered (the units gathered for the next step), which the load made stale."""
        self.release()
        for u in self.units:
            self.publish(u)
        self.settle()

    def publish(self, unit: Unit, ahead: bool = False) -> None:
        """A unit's updated fp32 shard into its compute weights: copied, then gathered under ZeRO-1/2, waited for by
        its next forward (or by settle()), so that the gather overlaps what comes first (the next units' update).
        ZeRO-3 gathers it so only if a training step comes next (`ahead`) and begins with it."""
        if unit.compute_shard is not unit.master:
            unit.compute_shard.copy_(unit.master)
        if unit.zero in (1, 2):
            unit.gather = self.comm.all_gather(unit.full, unit.compute_shard, unit.group, async_op=True,
                                               label=f"unit {unit.index}")
        elif ahead and unit in self.ahead:
            self._start_gather(unit)

    def settle(self) -> None:
        """Wait for the weight gathers in flight: the compute weights are then current."""
        for u in self.units:
            self._end_gather(u)

    def zero_grad(self) -> None:
        for u in self.units:
            if u.zero < 2:
                u.grad.zero_()


def _norm(t: torch.Tensor, norm: float) -> float:
    """t's L2 norm, given `norm`, fp32's: where its sum of squares overflowed (elements above 1.8e19), taken again
    scaled by the largest element; inf still where an element is."""
    if norm != math.inf:
        return norm
    top = float(t.abs().max())
    return top * float((t / top).norm()) if top < math.inf else norm
