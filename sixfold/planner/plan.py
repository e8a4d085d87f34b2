"""The plan of a layout on a cluster: each pipeline stage's memory per rank and the step's estimated time;
and the search over every layout of the world size, ranked by estimated throughput among those that fit."""
from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from ..config import Config, ConfigError, ParallelConfig, divisors, validate
from ..parallel.pipeline.schedules import build, placement
from ..parallel.pipeline.stages import split_stages
from .devices import Device, peak
from .memory import persistent, step as step_memory
from .rank import build_rank
from .timing import Estimate, estimate, model_flops_per_token

RESERVE = 0.9  # of device memory usable by the model (the rest: allocator, kernels' workspace, NCCL)
# a search of this many layouts or more plans them in a process per CPU (each takes seconds to start, importing torch)
PARALLEL_FROM = 200
CHUNK = 12  # layouts a worker plans at a time: layouts that differ only in recomputation (3 modes) share a build


@dataclass
class StagePlan:
    rank: int
    memory: dict[str, int]  # parameters, gradients, optimizer, saved, working, transient, peak
    estimate: Estimate


@dataclass
class Plan:
    cfg: Config
    stages: list[StagePlan]
    step_s: float
    tokens_per_s: float
    mfu: float
    fits: bool

    @property
    def peak(self) -> int:
        """The fullest planned rank's peak bytes."""
        return max(s.memory["peak"] for s in self.stages)


def _pp_ranks(cfg: Config, ends_only: bool) -> list[int]:
    """The pipeline ranks to plan: all; or with `ends_only`, the first and last (the embedding's and the head's)
    and of the others, which hold blocks only, the one with the most: of those with as many, the first (the most
    pairs in flight), and under a schedule with W's the last too (the most pairs waiting for their W, which hold
    more than they had saved under sequence-TP or recomputation, less without). A V placement (zb-v) puts both
    ends on the first rank and its middle ranks' crowds differ: all of them are planned."""
    p = cfg.parallel
    where = placement(p.pp, p.pp_virtual_stages, p.pp_schedule)
    if not ends_only or p.pp <= 2 or where[-1] == 0:
        return list(range(p.pp))
    blocks = [0] * p.pp
    for stage in split_stages(cfg.model, p.pp * p.pp_virtual_stages, cfg.train.seq_len):
        blocks[where[stage.index]] += len(stage.layers)
    fullest = max(blocks[1:-1])
    most = [r for r in range(1, p.pp - 1) if blocks[r] == fullest]
    waits = build(p.pp_schedule, p.pp, p.pp_virtual_stages, cfg.train.micro_batches).splits
    return sorted({0, p.pp - 1, most[0], most[-1] if waits else most[0]})


def plan(cfg: Config, device: Device, per_node: int, ends_only: bool = False, cpu: bool = False) -> Plan:
    """Every pipeline stage's first rank planned (with `ends_only`, three at most: see _pp_ranks); `cpu`: the ranks
    are CPUs (Rank.cpu)."""
    p = cfg.parallel
    world = p.world_size
    stride = world // p.pp  # pp is the outermost mesh dimension
    chosen = _pp_ranks(cfg, ends_only)
    stages = []
    for stage in chosen:
        rank = build_rank(cfg, stage * stride, cpu)
        memory = {**persistent(rank), **step_memory(rank)}
        memory["peak"] = sum(memory.values())
        stages.append(StagePlan(stage * stride, memory, estimate(rank, device, per_node)))
    step = max(s.estimate.step_s for s in stages)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    work = model_flops_per_token(cfg.model, cfg.train.seq_len) * tokens
    return Plan(cfg, stages, step, tokens / step, work / (step * world * peak(device, cfg.train.precision)),
                all(s.memory["peak"] <= RESERVE * device.memory for s in stages))


PP_SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2))  # (schedule, virtual stages)
SEARCHED = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "pp_schedule", "pp_virtual_stages", "zero",
            "reshard_after_forward")  # the parallel settings layouts() sets
# the settings each layout of a search has its own value of (a given one is not kept): reshard_after_forward is kept
CHOSEN = (*(f"parallel.{k}" for k in SEARCHED if k != "reshard_after_forward"), "model.recompute",
          "train.micro_batches")


def layouts(cfg: Config, world: int, per_node: int, refused: dict[str, str] | None = None):
    """Every layout of `world` ranks for cfg's model and global batch: tp within a node, zero 1 or 3 when
    sharded (1 under pipelining), under pipelining one sequence per micro-batch and each of PP_SCHEDULES, each
    recomputation mode, and for an MoE model each ep that divides the experts and the ranks that read different
    tokens. Those that validation refuses go into `refused` (the layout's description: the reason)."""
    m, t = cfg.model, cfg.train

    def valid(c: Config) -> bool:
        """Whether validation takes layout `c`; if not, its reason goes into `refused`."""
        try:
            validate(c, world_size=world)
        except ConfigError as e:
            if refused is not None:
                refused[c.parallel.describe()] = str(e)
            return False
        return True

    def unsharded(tp: int, cp: int, pp: int, dp: int) -> Config:
        """The layout with dp replicas and nothing sharded: one to name a reason that holds whatever else is chosen."""
        c = copy.deepcopy(cfg)
        c.parallel.tp, c.parallel.cp, c.parallel.pp, c.parallel.dp_replicate = tp, cp, pp, dp
        c.parallel.dp_shard, c.parallel.zero, c.parallel.ep, c.parallel.reshard_after_forward = 1, 0, 1, None
        c.train.reduce_each_micro_batch, c.train.micro_batches = False, 1
        return c

    for tp, cp, pp in itertools.product(divisors(min(world, per_node)), divisors(world), divisors(world)):
        rest = world // (tp * cp * pp) if world % (tp * cp * pp) == 0 else 0
        if not rest:
            continue
        if m.n_heads % tp:
            if refused is not None:
                valid(unsharded(tp, cp, pp, rest))
            continue
        for replicate in divisors(rest):
            shard = rest // replicate
            dp = replicate * shard
            if t.global_batch % dp:
                if refused is not None and shard == 1:  # (once for the data-parallel size)
                    valid(unsharded(tp, cp, pp, replicate))
                continue
            # under pipelining ZeRO-3 gathers once per step: its peak and traffic are ZeRO-1's, a duplicate row
            zeros = (0,) if shard * cp == 1 else (1,) if pp > 1 else (1, 3)
            eps = [e for e in divisors(shard * cp) if m.moe_experts % e == 0] if m.moe_experts else [1]
            schedules = PP_SCHEDULES if pp > 1 else PP_SCHEDULES[:1]
            # recomputation innermost: build_rank builds the rest once for the three
            for zero, ep, (schedule, v), recompute in itertools.product(zeros, eps, schedules,
                                                                         ("none", "selective", "full")):
                c = copy.deepcopy(cfg)
                c.parallel.dp_replicate, c.parallel.dp_shard, c.parallel.tp, c.parallel.cp = replicate, shard, tp, cp
                c.parallel.pp, c.parallel.zero, c.parallel.ep = pp, zero, ep
                c.parallel.pp_schedule, c.parallel.pp_virtual_stages = schedule, v
                c.parallel.reshard_after_forward = cfg.parallel.reshard_after_forward if zero == 3 else None
                c.train.reduce_each_micro_batch = t.reduce_each_micro_batch and zero >= 2 and pp == 1
                c.model.recompute = recompute
                c.train.micro_batches = t.global_batch // dp if pp > 1 else 1
                if valid(c):
                    yield c


def _fewest_micro_batches(c: Config, device: Device, per_node: int) -> Plan:
    """Without pipelining, the plan with the fewest micro-batches that fits, or else the leanest of one and of one
    sequence per micro-batch; under pipelining, the layout's own. From two micro-batches on, memory falls as they
    grow (if one sequence per micro-batch does not fit, no other count from two does); from one to two it can rise:
    ZeRO-2/3 then hold the whole gradients between micro-batches, unless they reduce each one, which holds less but
    waits at each one's end: under ZeRO-2/3 counts from two are planned both ways, the faster that fits kept."""
    if c.parallel.pp > 1:
        return plan(c, device, per_node, ends_only=True)

    def with_micro(micro: int, reduce_each: bool) -> Plan:
        trial = copy.deepcopy(c)
        trial.train.micro_batches = micro
        if micro > 1:  # (one micro-batch keeps the config's: reducing each is the same there)
            trial.train.reduce_each_micro_batch = reduce_each
        return plan(trial, device, per_node, ends_only=True)

    one, *more = divisors(c.train.global_batch // (c.parallel.dp_replicate * c.parallel.dp_shard))
    first = with_micro(one, False)
    if first.fits or not more:
        return first
    given = c.train.reduce_each_micro_batch
    found = [_fewest(functools.partial(with_micro, reduce_each=each), more)
             for each in ((False, True) if c.parallel.zero >= 2 and not given else (given,))]
    fits = [p for p in found if p.fits]
    return min(fits, key=lambda p: p.step_s) if fits else min([first, *found], key=lambda p: p.peak)


def _fewest(with_micro, counts: list[int]) -> Plan:
    """with_micro(k) for the fewest of `counts` (rising; memory falling) that fits, else for the last."""
    *fewer, most = counts
    last = with_micro(most)
    return next((p for p in map(with_micro, fewer) if p.fits), last) if last.fits else last


def _plan_all(todo: list[Config], device: Device, per_node: int):
    """_fewest_micro_batches of each layout, in order: from PARALLEL_FROM layouts on, in a process per CPU this
    one may use."""
    one = functools.partial(_fewest_micro_batches, device=device, per_node=per_node)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(cpus, -(-len(todo) // CHUNK))
    if len(todo) < PARALLEL_FROM or workers < 2:
        yield from map(one, todo)
        return
    # spawned: this process may hold threads; Ctrl-C is this process's to handle
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), initializer=signal.signal,
                               initargs=(signal.SIGINT, signal.SIG_IGN))
    try:
        yield from pool.map(one, todo, chunksize=CHUNK)
    finally:
        pool.shutdown(cancel_futures=True)


def search(cfg: Config, world: int, device: Device, per_node: int, refused: dict[str, str] | None = None,
           progress=lambda plans, total: plans) -> list[Plan]:
    """Plans of every layout that fits, fastest first; without pipelining, each with the fewest micro-batches
    that fits. Layouts that validation refuses go into `refused` (description: reason). `progress` wraps the
    plans as they come, `total` of them (a progress bar). cfg's own layout plays no part: what it sets beside it
    is checked as one process would run it, at once."""
    alone = copy.deepcopy(cfg)  # the settings the search keeps as they are (cp_mode, timeout_s, ...) stay
    alone.parallel = dataclasses.replace(cfg.parallel, **{k: getattr(ParallelConfig, k) for k in SEARCHED})
    alone.train.reduce_each_micro_batch, alone.train.micro_batches = False, 1  # each layout chooses its own
    validate(alone)
    todo = list(layouts(cfg, world, per_node, refused))
    plans = list(progress(_plan_all(todo, device, per_node), len(todo)))
    if not plans:
        raise ConfigError(f"no layout of {world} GPUs divides this model and batch (tp must divide model.n_heads="
                          f"{cfg.model.n_heads}, pp be at most model.n_layers+2={cfg.model.n_layers + 2}, the "
                          f"data-parallel size divide train.global_batch={cfg.train.global_batch}, cp divide "
                          f"train.seq_len={cfg.train.seq_len}); choose another --gpus or change those settings")
    fits = sorted((p for p in plans if p.fits), key=lambda p: (p.step_s, _wire(p), p.peak))
    if not fits:
        raise ConfigError(_none_fits(plans, device))
    return fits


def _wire(plan: Plan) -> float:
    """Seconds of traffic on the wire of the slowest stage: of layouts planned as fast (their traffic hidden behind
    compute), the one that sends less depends less on that overlap, and of those the leaner comes first."""
    return sum(max(plan.stages, key=lambda s: s.estimate.step_s).estimate.comm_s.values())


def _none_fits(plans: list[Plan], device: Device) -> str:
    """What to change when no layout fits: more memory per GPU when even the persistent buffers (weights,
    gradients, optimizer state) of the leanest layout exceed it, else less activation memory."""
    usable = RESERVE * device.memory / 1e9
    lean = min(plans, key=lambda p: max(_persistent(s) for s in p.stages))
    held = max(_persistent(s) for s in lean.stages) / 1e9
    if held > usable:
        return (f"no layout fits: even {lean.cfg.parallel.describe()} holds {held:.1f} GB of weights, gradients and "
                f"optimizer state per GPU, above the {usable:.0f} GB usable on an {device.name}: add GPUs (ZeRO, tp "
                f"and pp divide those over them), or choose a GPU with more memory (--gpu)")
    best = min(plans, key=lambda p: p.peak)
    t, p = best.cfg.train, best.cfg.parallel
    sequences = t.global_batch // (p.dp_replicate * p.dp_shard) // t.micro_batches
    return (f"no layout fits: the leanest, {best.cfg.parallel.describe()} with recompute {best.cfg.model.recompute},"
            f" peaks at {best.peak / 1e9:.1f} GB per GPU, above the {usable:.0f} GB usable on an {device.name}, with "
            f"{sequences} sequence(s) per micro-batch: lower train.seq_len, or add GPUs (for tp, cp or pp)"
            + ("" if best.cfg.model.loss_chunk else "; the search keeps model.loss_chunk as given: with "
               "model.loss_chunk=4096 the layouts without tp never hold the whole logits"))


def _persistent(stage: StagePlan) -> int:
    return sum(stage.memory[k] for k in ("parameters", "gradients", "optimizer"))
