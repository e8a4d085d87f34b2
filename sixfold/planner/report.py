"""What `sixfold plan` prints."""
from __future__ import annotations

import re

from ..config import Config
from ..mesh import ParallelDims
from .plan import Plan

GB = 1e9


def num(x: float) -> str:
    """One decimal, or two significant digits below 0.1 (a tiny model's milliseconds and GB are not 0.0)."""
    return f"{x:.1f}" if x >= 0.1 or x == 0 else f"{x:.2g}"


def _unit(peak: float) -> tuple[str, float]:
    """GB, or MB for a peak under 0.1 GB (a test model's), and its size in bytes."""
    return ("GB", GB) if peak >= GB / 10 else ("MB", 1e6)


def _reduced_each(cfg) -> bool:
    """Whether the plan reduces each of several micro-batches (with one, the setting changes nothing)."""
    return cfg.train.reduce_each_micro_batch and cfg.train.micro_batches > 1


def describe(p: Plan, device: str, gpus: int, nodes: int) -> str:
    cfg = p.cfg
    unit, scale = _unit(p.peak)
    each = ", each reduced" if _reduced_each(cfg) else ""
    lines = [f"{cfg.parallel.describe()} {_workload(cfg, device, gpus, nodes)}, {cfg.train.micro_batches} "
             f"micro-batch(es){each}, recompute {cfg.model.recompute}",
             "", f"memory per rank ({unit})    params  grads  optim  activ  working  transient   peak",
             ]
    for s in p.stages:
        m = s.memory
        lines.append(f"  stage of rank {s.rank:<8} " + "  ".join(
            f"{m[k] / scale:>{w}.2f}" for k, w in (("parameters", 6), ("gradients", 5), ("optimizer", 5),
                                                    ("saved", 5), ("working", 7), ("transient", 9), ("peak", 6))))
    worst = max(p.stages, key=lambda s: s.estimate.step_s).estimate
    comm = ", ".join(f"{g} {num(t * 1e3)}" for g, t in sorted(worst.comm_s.items(), key=lambda kv: -kv[1]))
    lines += ["", f"step (slowest stage): compute {num(worst.compute_s * 1e3)} ms, pipeline bubble "
                  f"{worst.bubble:.1%}, traffic ms on the wire: {comm or 'none'}",
              f"estimated step {num(p.step_s * 1e3)} ms, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}; "
              f"{'fits' if p.fits else 'does NOT fit'} in memory" + ("" if p.fits else f": {_leaner(cfg)}, or add "
                                                                     "GPUs; --search ranks the layouts that fit")]
    crossing = _crossing(cfg, gpus, nodes)
    if crossing:
        named = " and ".join(f"{g}={getattr(cfg.parallel, g)}" for g in crossing)
        within = " and ".join(dict.fromkeys("tp x ep" if g == "ep" else "tp x cp" for g in crossing))
        lines.append(f"note: {named} groups span nodes ({gpus // nodes} GPU(s) each), so their collectives, on the "
                     f"critical path of every layer, cross the network; keep them within a node ({within} dividing "
                     f"the GPUs per node)")
    return "\n".join(lines + _full_fp32(cfg))


def _crossing(cfg: Config, gpus: int, nodes: int) -> list[str]:
    """The groups of tp, cp and ep whose collectives, in every layer, would cross the network."""
    dims = ParallelDims.from_config(cfg.parallel)
    return [g for g in ("tp", "cp", "ep") if getattr(cfg.parallel, g) > 1 and dims.crosses_nodes(g, gpus // nodes)]


def _leaner(cfg: Config) -> str:
    """The settings that would hold less, of those the config does not use yet."""
    shard = ([] if cfg.parallel.zero == 3 else ["parallel.zero=3"]) + ["tp", "pp", "cp"]
    out = [f"shard more ({', '.join(shard)})"]
    if cfg.model.recompute != "full":
        out.append("recompute (model.recompute=selective or full)")
    if not cfg.model.loss_chunk and cfg.parallel.tp == 1:
        out.append("never hold the whole logits (model.loss_chunk=4096)")
    return ", ".join(out)


def _workload(cfg: Config, device: str, gpus: int, nodes: int) -> str:
    return (f"on {gpus} x {device} ({nodes} node(s)); {cfg.model.num_params():,} parameters, global batch "
            f"{cfg.train.global_batch} x {cfg.train.seq_len} tokens, {cfg.train.precision}")


def ranking(plans: list[Plan], cfg: Config, where: tuple[str, int, int], refused: dict[str, str] | None = None,
            top: int = 10) -> str:
    """What was searched (cfg on `where`: device, GPUs, nodes); the fastest `top` plans; then the layouts left out
    because the trainer would refuse them (refusals)."""
    wide = max([48] + [len(p.cfg.parallel.describe()) for p in plans[:top]])  # the layout column, to its longest
    unit, scale = _unit(max((p.peak for p in plans[:top]), default=GB))
    lines = [f"layouts {_workload(cfg, *where)}",
             f"{'layout':<{wide}} {'micro':>5} {'recompute':>9} {'peak ' + unit:>8} {'step ms':>8} {'tokens/s':>11} "
             f"{'MFU':>6}"]
    for p in plans[:top]:
        micro = f"{p.cfg.train.micro_batches}{'*' if _reduced_each(p.cfg) else ''}"
        lines.append(f"{p.cfg.parallel.describe():<{wide}} {micro:>5} {p.cfg.model.recompute:>9} "
                     f"{num(p.peak / scale):>8} {num(p.step_s * 1e3):>8} {p.tokens_per_s:>11,.0f} {p.mfu:>6.1%}")
    fit = "1 layout fits" if len(plans) == 1 else f"{len(plans)} layouts fit; fastest first"
    lines.append(f"({fit}" + (f", the first {top} shown: --top" if top < len(plans) else "") + ")")
    if any(_reduced_each(p.cfg) for p in plans[:top]):
        lines.append("(* with train.reduce_each_micro_batch=true)")
    spanning = {i + 1: _crossing(p.cfg, where[1], where[2]) for i, p in enumerate(plans[:top])}
    if any(spanning.values()):
        rows = ", ".join(f"{i} ({' and '.join(g)})" for i, g in spanning.items() if g)
        lines.append(f"(groups that span nodes, whose collectives cross the network in every layer: rows {rows})")
    return "\n".join(lines + _full_fp32(cfg) + refusals(refused or {}))


def _full_fp32(cfg: Config) -> list[str]:
    """A note that an fp32 plan (the configs' default) is not what GPUs train in."""
    return ["note: planned in fp32, as the config has it, which sixfold runs without tensor cores; "
            "train.precision=bf16 plans mixed precision"] if cfg.train.precision == "fp32" else []


def refusals(refused: dict[str, str]) -> list[str]:
    """A line per kind of reason the trainer gave for refusing layouts (description: reason): how many parallel
    layouts, and one of them with its reason."""
    kinds: dict[str, list] = {}
    for layout, reason in refused.items():
        kinds.setdefault(re.sub(r"\d+", "N", reason), [0, layout, reason])[0] += 1
    return [f"not planned: {count} parallel layout(s) that the trainer refuses, e.g. {layout}: {reason}"
            for count, layout, reason in kinds.values()]
