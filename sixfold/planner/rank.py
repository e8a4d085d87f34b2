"""One rank of a layout, built without running it: its model on the meta device (its pipeline stages and its
tp and ep pieces, with shapes and no memory) and the FSDP units the trainer would make of it."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..comm import Comm
from ..config import Config
from ..mesh import ParallelContext, ParallelDims
from ..model.llama import Llama
from ..model.moe import MoE
from ..parallel.context import ContextParallel
from ..parallel.expert import ExpertParallel
from ..parallel.pipeline import schedules
from ..parallel.pipeline.schedules import Schedule
from ..parallel.pipeline.simulate import Costs, RankStats, simulate
from ..parallel.pipeline.stages import split_stages, stage_costs
from ..parallel.sharding import Sharded
from ..parallel.tensor import TensorParallel
from ..trace import Tracer


@dataclass
class Rank:
    cfg: Config
    ctx: ParallelContext  # sizes and coordinates only: no process groups
    model: Llama
    sharded: Sharded
    schedule: Schedule | None
    costs: Costs | None  # under pipelining, the simulator's costs of every stage (stage_costs)
    cpu: bool = False  # the ranks are CPUs (the tests, bench --max-seq on a CPU): their reduce-scatter stages its input

    @property
    def compute_bytes(self) -> int:
        return 2 if self.cfg.train.precision == "bf16" else 4

    @property
    def reduce_bytes(self) -> int:
        return 2 if self.cfg.train.grad_reduce == "bf16" else 4

    @property
    def micro_tokens(self) -> int:
        """Tokens of one micro-batch on this rank (its cp part of each sequence; before sequence-TP's split)."""
        t, ctx = self.cfg.train, self.ctx
        return t.global_batch // ctx.size("batch") // t.micro_batches * t.seq_len // ctx.size("cp")

    @property
    def hidden_tokens(self) -> int:
        """Rows of the hidden state between sub-layers: split over tp under sequence-TP."""
        return self.micro_tokens // self.model.tp.size if self.model.tp.sequence else self.micro_tokens

    @property
    def routed_rows(self) -> int:
        """Rows an MoE layer routes from this rank's hidden state, top_k per token (with balanced routing over ep,
        also the rows reaching its experts)."""
        return self.hidden_tokens * self.cfg.model.moe_top_k

    def moe(self, layer: int) -> MoE | None:
        """Block `layer`'s MLP if it is an MoE layer, else None."""
        return self._moes[layer]

    @functools.cached_property
    def _moes(self) -> dict[int, MoE | None]:
        return {int(k): b.mlp if isinstance(b.mlp, MoE) else None for k, b in self.model.layers.items()}

    @property
    def pipeline(self) -> RankStats | None:
        """This rank's line of the simulated schedule, each stage costing its FLOPs: its bubble (which counts the
        time it waits for heavier stages), peak in flight and crowds of (stage, micro-batch) pairs in flight."""
        if self.schedule is None:
            return None
        p = self.cfg.parallel
        return _simulation(p.pp_schedule, p.pp, p.pp_virtual_stages, self.cfg.train.micro_batches,
                           self.costs).ranks[self.ctx.rank_in("pp")]

    @property
    def blocks(self) -> list[int]:
        return [int(k) for k in self.model.layers.keys()]


@functools.lru_cache(maxsize=256)
def _schedule(name: str, pp: int, v: int, m: int) -> Schedule:
    return schedules.build(name, pp, v, m)


@functools.lru_cache(maxsize=256)
def _simulation(name: str, pp: int, v: int, m: int, costs: Costs):
    return simulate(_schedule(name, pp, v, m), costs)


def build_rank(cfg: Config, rank: int, cpu: bool = False) -> Rank:
    p, t = cfg.parallel, cfg.train
    stages = split_stages(cfg.model, p.pp * p.pp_virtual_stages, t.seq_len)
    schedule = _schedule(p.pp_schedule, p.pp, p.pp_virtual_stages, t.micro_batches) if p.pp > 1 else None
    same = dataclasses.replace(cfg.model, recompute="none")
    # what _build reads: neither recomputation nor the micro-batch count change it
    key = repr(same), repr(p), t.precision, t.seq_len, schedule and schedule.placement, rank
    if key not in _BUILT:
        if len(_BUILT) == 16:
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = _build(dataclasses.replace(cfg, model=same), rank, stages, schedule)
    ctx, model, sharded = _BUILT[key]
    costs = stage_costs(cfg.model, stages, t.seq_len, schedule.splits) if schedule else None
    return Rank(cfg, ctx, model, sharded, schedule, costs, cpu)


_BUILT: dict = {}  # build_rank's key -> _build's, the last 16


def _build(cfg: Config, rank: int, stages, schedule: Schedule | None):
    """The rank's context, model and units, which recomputation does not change: a search plans each layout in
    every mode one after another and builds them once."""
    p, t = cfg.parallel, cfg.train
    ctx = ParallelContext(ParallelDims.from_config(p), rank, "gloo", torch.device("meta"), {})
    comm = Comm(ctx, Tracer(False, rank))
    mine = [s for s in stages if schedule is None or schedule.placement[s.index] == ctx.rank_in("pp")]
    with torch.device("meta"):
        model = Llama(cfg.model, TensorParallel(comm, p.sequence_parallel), ContextParallel(comm, p.cp_mode,
                      p.cp_zigzag), mine, ExpertParallel(comm))
    dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    return ctx, model, Sharded(model, comm, p.zero, p.reshard, dtype)
