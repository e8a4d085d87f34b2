"""The parity matrix: layouts of every pair of dimensions and the big combinations, each checked against the
single-process reference (sixfold.parity), all trained in one torchrun job (sixfold.multirun) so that the
processes start once. `sixfold matrix CONFIG` runs it and writes its table; tests/test_parity.py runs it in CI.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import step_dir
from .config import ConfigError, load_config
from .launch import run_torchrun
from .multirun import read_results, write_plan
from .parity import (LEARN_STEPS, ParityResult, compare, compare_learning, layout_config, reference_config,
                     reference_key, runs_dir, settle)

STEPS = 4  # fp32 parity
RESUME_AT = 2  # a resumed layout starts from its source's checkpoint of this step
TIMEOUT_S = 120  # a collective of a layout that waits longer fails it (the job goes on)


@dataclass(frozen=True)
class Layout:
    name: str
    overrides: tuple[str, ...]
    resumes: str = ""  # the earlier layout whose checkpoint of step RESUME_AT this one resumes
    bf16: bool = False  # checked to learn like fp32 over LEARN_STEPS, not to round-off


ACCUM = ("train.micro_batches=2",)
EACH = ("train.reduce_each_micro_batch=true",)
TIED = ("model.tie_embeddings=true",)
MOE = ("model.moe_experts=4", "model.moe_top_k=2")
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "breadth-first": 2, "zb-h1": 1, "zb-v": 2}
BIG = ("parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2", "parallel.cp=2", "parallel.zero=3", *ACCUM)


def _layouts() -> list[Layout]:
    out = {
        "single-accum4": ("train.micro_batches=4",),
        "dp2": ("parallel.dp_replicate=2",),
        "dp4": ("parallel.dp_shard=4",),
        "dp2-accum": ("parallel.dp_replicate=2", *ACCUM),
        "dp4-accum": ("parallel.dp_shard=4", *ACCUM),
        "dp2x2-tied": ("parallel.dp_replicate=2", "parallel.dp_shard=2", *TIED),
    }
    for shards in (2, 4):
        for zero in (1, 2, 3):
            out[f"dp_shard{shards}-zero{zero}"] = (f"parallel.dp_shard={shards}", f"parallel.zero={zero}", *ACCUM)
    out["dp_shard4-zero3-keep-gathered"] = ("parallel.dp_shard=4", "parallel.zero=3",
                                            "parallel.reshard_after_forward=false", *ACCUM)
    out["hsdp2x2-zero3"] = ("parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero=3", *ACCUM)
    out["hsdp2x2-zero2-tied"] = ("parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero=2", *TIED, *ACCUM)
    out["hsdp2x2-zero2-tied-reduce-each"] = ("parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero=2",
                                             *TIED, *ACCUM, *EACH)
    # three shards: the tiny model's embedding and blocks are no multiple of 16 * 3 elements, so the last rank's
    # shards of them end in padding (which its grad norm, AdamW and the checkpoint's slices leave out)
    out["hsdp2x3-zero3-tied-padded-reduce-each"] = ("parallel.dp_replicate=2", "parallel.dp_shard=3", "parallel.zero=3",
                                                    "train.global_batch=12", *TIED, *ACCUM, *EACH)
    out["dp_shard2-zero3-accum4-reduce-each"] = ("parallel.dp_shard=2", "parallel.zero=3", "train.micro_batches=4",
                                                 *EACH)
    for tp in (2, 4):
        out[f"tp{tp}"] = (f"parallel.tp={tp}",)
        out[f"tp{tp}-no-sequence-tp"] = (f"parallel.tp={tp}", "parallel.sequence_parallel=false")
    out["tp2-tied"] = ("parallel.tp=2", *TIED, *ACCUM)
    out["tp4-tied-padded-vocab"] = ("parallel.tp=4", *TIED, "model.vocab_size=322")
    out["tp2xdp_shard2-zero3"] = ("parallel.tp=2", "parallel.dp_shard=2", "parallel.zero=3", *ACCUM)
    out["tp2xdp_shard2-zero3-reduce-each"] = ("parallel.tp=2", "parallel.dp_shard=2", "parallel.zero=3", *ACCUM, *EACH)
    out["tp2xhsdp2x2-zero2-tied"] = ("parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=2",
                                     "parallel.zero=2", *TIED)
    for mode in ("ring", "allgather", "ulysses"):
        for cp in (2, 4):
            out[f"cp{cp}-{mode}"] = (f"parallel.cp={cp}", f"parallel.cp_mode={mode}")
    out["cp4-ring-contiguous"] = ("parallel.cp=4", "parallel.cp_zigzag=false")
    out["cp2xtp2-ring"] = ("parallel.cp=2", "parallel.tp=2")
    out["cp2xtp2-ulysses-tied"] = ("parallel.cp=2", "parallel.tp=2", "parallel.cp_mode=ulysses", *TIED)
    out["cp2xdp_shard2-zero3"] = ("parallel.cp=2", "parallel.dp_shard=2", "parallel.zero=3", *ACCUM)
    out["cp2xdp2"] = ("parallel.cp=2", "parallel.dp_replicate=2", *ACCUM)
    for pp, layers, micro in ((2, 4, 4), (4, 6, 8)):
        for schedule, v in VIRTUAL.items():
            out[f"pp{pp}-{schedule}"] = (f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}",
                                         f"parallel.pp_virtual_stages={v}", f"model.n_layers={layers}",
                                         f"train.micro_batches={micro}")
    # zb-v with m = pp micro-batches: filled greedily, not in the V built for m >= 2pp
    out["pp2-zb-v-accum"] = ("parallel.pp=2", "parallel.pp_schedule=zb-v", "parallel.pp_virtual_stages=2",
                             "model.n_layers=4", *ACCUM)
    out["pp2xdp2"] = ("parallel.pp=2", "parallel.dp_replicate=2", *ACCUM)
    out["pp2xdp_shard2-zero1"] = ("parallel.pp=2", "parallel.dp_shard=2", "parallel.zero=1", *ACCUM)
    out["pp2xdp_shard2-zero3-zb-h1"] = ("parallel.pp=2", "parallel.dp_shard=2", "parallel.zero=3",
                                        "parallel.pp_schedule=zb-h1", *ACCUM)
    out["pp2xtp2"] = ("parallel.pp=2", "parallel.tp=2", *ACCUM)
    out["pp2xcp2"] = ("parallel.pp=2", "parallel.cp=2", *ACCUM)
    out["pp2-tied"] = ("parallel.pp=2", *TIED, *ACCUM)
    out["pp2-interleaved-tied"] = ("parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2",
                                   "model.n_layers=4", *TIED, "train.micro_batches=4")
    out["pp2-zb-v-tied-xtp2"] = ("parallel.pp=2", "parallel.pp_schedule=zb-v", "parallel.pp_virtual_stages=2",
                                 "parallel.tp=2", *TIED, "train.micro_batches=4")
    out["ep2"] = (*MOE, "parallel.dp_shard=2", "parallel.ep=2")
    out["ep4"] = (*MOE, "parallel.dp_shard=4", "parallel.ep=4")
    out["ep2xdp_shard2-zero3"] = (*MOE, "parallel.dp_shard=2", "parallel.ep=2", "parallel.zero=3")
    out["ep2xdp_shard2-zero2-reduce-each"] = (*MOE, "parallel.dp_shard=2", "parallel.ep=2", "parallel.zero=2", *ACCUM,
                                              *EACH)  # the experts' units, not sharded (edp = 1), reduced once
    out["ep2xdp_shard4-zero3"] = (*MOE, "parallel.dp_shard=4", "parallel.ep=2", "parallel.zero=3", *ACCUM)
    out["ep2xhsdp2x2-zero2"] = (*MOE, "parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2",
                                "parallel.zero=2")
    out["ep2xtp2"] = (*MOE, "parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2")
    out["ep2xpp2-zb-h1"] = (*MOE, "parallel.dp_shard=2", "parallel.ep=2", "parallel.pp=2",
                            "parallel.pp_schedule=zb-h1", *ACCUM)
    out["ep2xcp2"] = (*MOE, "parallel.cp=2", "parallel.ep=2")
    out["ep2xtp2-top1-switch"] = ("model.moe_experts=4", "model.moe_top_k=1", "model.moe_norm_topk=false",
                                  "parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2", *ACCUM)
    out["ep2-shared-every2-zero1"] = (*MOE, "model.moe_shared_expert=true", "model.moe_every=2",
                                      "parallel.dp_shard=2", "parallel.ep=2", "parallel.zero=1")
    out["dp_shard2-zero3-recompute-full"] = ("parallel.dp_shard=2", "parallel.zero=3", "model.recompute=full", *ACCUM)
    out["pp2xtp2-zb-v-recompute-full"] = ("parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=zb-v",
                                          "parallel.pp_virtual_stages=2", "train.micro_batches=4",
                                          "model.recompute=full")
    out["cp2-recompute-selective"] = ("parallel.cp=2", "model.recompute=selective")
    # RoPE scaling: llama3's three bands at the zigzag positions of cp's shards, linear under sequence-TP
    out["cp2-rope-llama3"] = ("parallel.cp=2", "model.rope_scaling=llama3", "model.rope_factor=8",
                              "model.rope_original_len=64")
    out["tp2-rope-linear"] = ("parallel.tp=2", "model.rope_scaling=linear", "model.rope_factor=4")
    out["pp2xcp2xdp_shard2-zero3-loss-chunk-tied"] = ("parallel.pp=2", "parallel.cp=2", "parallel.dp_shard=2",
                                                      "parallel.zero=3", "model.loss_chunk=24", *TIED, *ACCUM)
    # three and four dimensions at once
    pp_v = ("parallel.pp=2", "parallel.pp_virtual_stages=2", "model.n_layers=4", "train.micro_batches=4")
    out["pp2xcp2xtp2-interleaved"] = (*pp_v, "parallel.pp_schedule=interleaved", "parallel.cp=2", "parallel.tp=2")
    out["pp2xcp2xtp2-zb-v-tied"] = (*pp_v, "parallel.pp_schedule=zb-v", "parallel.cp=2", "parallel.tp=2", *TIED)
    out["pp2xcp2xtp2-ulysses"] = ("parallel.pp=2", "parallel.cp=2", "parallel.tp=2", "parallel.cp_mode=ulysses",
                                  *ACCUM)
    out["pp2xdp_shard2xcp2xtp2-zero3-tied"] = (*BIG, *TIED)
    out["ep2xpp2xdp_shard2xcp2xtp2-zero3"] = (*BIG, *MOE, "parallel.ep=2")
    out["hsdp2x2xtp2xpp2-zero3"] = ("parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2",
                                    "parallel.pp=2", "parallel.zero=3", *ACCUM)
    out["pp4xcp2xtp2-zb-v"] = ("parallel.pp=4", "parallel.pp_schedule=zb-v", "parallel.pp_virtual_stages=2",
                               "model.n_layers=6", "train.micro_batches=8", "parallel.cp=2", "parallel.tp=2")
    out["cp4xtp4"] = ("parallel.cp=4", "parallel.tp=4")
    out["hsdp2x2xcp2xtp2-ulysses-zero3"] = ("parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.cp=2",
                                            "parallel.tp=2", "parallel.cp_mode=ulysses", "parallel.zero=3", *ACCUM)
    out["dp2xpp2xcp2xtp2-allgather-breadth-first"] = (*pp_v, "parallel.pp_schedule=breadth-first",
                                                      "parallel.dp_replicate=2", "parallel.cp=2", "parallel.tp=2",
                                                      "parallel.cp_mode=allgather")
    out["ep4xpp2xdp_shard4xtp2-zero3"] = (*MOE, "parallel.ep=4", "parallel.pp=2", "parallel.dp_shard=4",
                                          "parallel.tp=2", "parallel.zero=3", *ACCUM)
    out["ep2xhsdp2x2xpp2-zero3-tied"] = (*MOE, "parallel.ep=2", "parallel.dp_replicate=2", "parallel.dp_shard=2",
                                         "parallel.pp=2", "parallel.zero=3", *TIED, *ACCUM)
    layouts = [Layout(name, overrides) for name, overrides in out.items()]
    layouts.append(Layout("resumed-as-hsdp2x2xtp4-zero1", ("parallel.dp_replicate=2", "parallel.dp_shard=2",
                                                           "parallel.tp=4", "parallel.zero=1", *TIED, *ACCUM),
                          resumes="pp2xdp_shard2xcp2xtp2-zero3-tied"))
    layouts.append(Layout("moe-resumed-as-ep4xdp_shard4xtp4", (*MOE, "parallel.ep=4", "parallel.dp_shard=4",
                                                               "parallel.tp=4", *ACCUM),
                          resumes="ep2xpp2xdp_shard2xcp2xtp2-zero3"))
    bf16 = ("train.precision=bf16", "train.warmup_steps=5")
    layouts += [Layout("bf16-dp_shard2-zero3", (*bf16, "parallel.dp_shard=2", "parallel.zero=3"), bf16=True),
                Layout("bf16-dp2-bf16-reduce", (*bf16, "parallel.dp_replicate=2", "train.grad_reduce=bf16"), bf16=True),
                Layout("bf16-dp_shard2-zero2-reduce-each-bf16-reduce", (*bf16, "parallel.dp_shard=2", "parallel.zero=2",
                                                                         "train.grad_reduce=bf16", *ACCUM, *EACH),
                       bf16=True),
                Layout("bf16-pp2xdp_shard2xtp2-zero3", (*bf16, "parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2",
                                                        "parallel.zero=3", *ACCUM), bf16=True)]
    return layouts


LAYOUTS = _layouts()


@dataclass
class Row:
    """One layout's outcome: its parity result, or why there is none."""
    layout: Layout
    ranks: int
    describe: str
    seconds: float = 0.0
    result: ParityResult | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok and not self.error

    def line(self) -> str:
        if self.result is None or self.error:
            return f"parity FAILED: {self.layout.name} ({self.describe}): {self.error}"
        return f"{self.layout.name}: {self.result.line()}, {self.seconds:.1f}s"


def _plan(config: str | None, overrides: list[str], layouts: list[Layout], root: Path):
    """The runs of the job (each reference once, before its first layout), each layout's row with its reference's
    name, and every run's directory."""
    runs, references, rows = [], {}, []
    sources = {layout.resumes for layout in layouts if layout.resumes}
    for layout in layouts:
        cfg = load_config(config, [*overrides, *layout.overrides])
        steps = LEARN_STEPS if layout.bf16 else STEPS
        ref = reference_config(cfg, root / "references" / str(len(references)), steps)
        key = reference_key(ref)
        if key not in references:
            references[key] = f"reference-{len(references)}"
            ref.log.every = steps
            runs.append((references[key], ref))
        mine = layout_config(cfg, root / "layouts" / layout.name, steps)
        mine.log.every = steps
        if layout.name in sources:
            mine.checkpoint.every = RESUME_AT
        if layout.resumes:
            mine.checkpoint.resume = str(step_dir(root / "layouts" / layout.resumes, RESUME_AT))
        runs.append((layout.name, mine))
        rows.append((Row(layout, cfg.parallel.world_size, cfg.parallel.describe()), references[key]))
    return runs, rows, {name: Path(r.log.run_dir) for name, r in runs}


@dataclass
class Report:
    rows: list[Row]  # in the matrix's order
    seconds: float  # the whole job, start-up included
    load: float  # the machine's 1-minute load average as the job started: other work sharing its cores
    kept: str = ""  # the temporary directory holding the runs, left to look into when a layout failed

    def table(self, command: str) -> str:
        """docs/parity.md: one line per layout, and how long the whole job took on this machine; `command`: the
        command line that ran the matrix."""
        rows, passed = self.rows, sum(row.ok for row in self.rows)
        lines = [
            "# Parity matrix",
            "",
            f"Written by `{command}` (`tests/test_parity.py` runs "
            f"the same matrix in CI and checks that this table lists its layouts): {len(rows)} layouts, {passed} "
            f"passed, one torchrun job of "
            f"{max(row.ranks for row in rows)} gloo ranks, {self.seconds:.0f}s on {os.cpu_count()} CPU cores "
            f"(shared: load average {self.load:.1f} as it started).",
            "",
            f"fp32 layouts: {STEPS} steps; loss = the largest `|layout - reference| / |reference|` over the "
            f"steps, weight = the largest per-parameter `RMS(layout - reference) / RMS(reference)` after the last "
            f"step, grad norm = the largest relative difference of a step's gradient norm, against the single-process "
            f"run of the same global batch. bf16 layouts: {LEARN_STEPS} steps; loss = the last loss's relative "
            f"difference from the fp32 reference (weights shown, not checked; grad norms not compared). A "
            f"resumed layout starts from its source's checkpoint of step {RESUME_AT}, in another layout. Seconds: "
            f"the layout's training in the shared job (start-up excluded).",
            "",
            "| layout | ranks | mesh | check | max loss diff | max weight diff | max grad-norm diff | seconds | "
            "result |",
            "|---|---:|---|---|---:|---:|---:|---:|---|",
        ]
        for row in rows:
            r = row.result
            kind = "bf16 learns" if row.layout.bf16 else "fp32 parity"
            if row.layout.resumes:
                kind += f", resumed from {row.layout.resumes}"
            loss = f"{r.loss_rel:.1e}" if r else "-"
            weight = f"{r.weight_rel:.1e}" if r else "-"
            norm = f"{r.norm_rel:.1e}" if r and not row.layout.bf16 else "-"
            verdict = "ok" if row.ok else f"FAILED: {row.error.splitlines()[0] if row.error else 'over tolerance'}"
            lines.append(f"| {row.layout.name} | {row.ranks} | {row.describe} | {kind} | {loss} | {weight} | {norm} | "
                         f"{row.seconds:.1f} | {verdict} |")
        return "\n".join(lines) + "\n"


def run(config: str | None, overrides: list[str] = (), workdir: str | None = None,
        only: list[str] | None = None) -> Report:
    """Train the matrix's layouts (all, or `only` these and the layouts they resume from) and their references
    in one job; compare each with its reference. Without `workdir` the runs go to a temporary directory, removed
    when every layout passes or a signal stops the job, and kept (and named) when one fails."""
    unknown = set(only or ()) - {layout.name for layout in LAYOUTS}
    misplaced = sorted(name for name in unknown if "=" in name or name.endswith((".yaml", ".yml")))
    if misplaced:  # --only takes every word after it
        raise ConfigError(f"--only {' '.join(only)}: {', '.join(misplaced)} is no layout; give the config and its "
                          f"overrides before --only (sixfold matrix CONFIG [key=value ...] --only NAME ...)")
    if unknown:
        raise ConfigError(f"no layout named {', '.join(sorted(unknown))} in the matrix; its layouts: "
                          f"{', '.join(layout.name for layout in LAYOUTS)}")
    wanted = set(only or [layout.name for layout in LAYOUTS])
    wanted |= {layout.resumes for layout in LAYOUTS if layout.name in wanted and layout.resumes}
    layouts = [layout for layout in LAYOUTS if layout.name in wanted]
    with runs_dir(workdir, "matrix") as root:
        report = _run(config, list(overrides), layouts, root)
    report.kept = settle(root, workdir, all(row.ok for row in report.rows))
    return report


def _run(config: str | None, overrides: list[str], layouts: list[Layout], root: Path) -> Report:
    runs, rows, dirs = _plan(config, overrides, layouts, root)
    plan = root / "plan.json"
    write_plan(plan, runs, TIMEOUT_S)
    start, load = time.perf_counter(), os.getloadavg()[0]
    proc = run_torchrun(max(row.ranks for row, _ in rows), [str(plan)], module="sixfold.multirun", stops=True)
    seconds = time.perf_counter() - start
    outcomes = read_results(plan)
    missing = {"ok": False, "error": f"not run: the job ended first (exit {proc.returncode}; its output is above)"}
    for row, ref_name in rows:
        _judge(row, outcomes.get(row.layout.name, missing), outcomes.get(ref_name, missing), dirs[row.layout.name],
               dirs[ref_name])
    return Report([row for row, _ in rows], seconds, load)


def _judge(row: Row, mine: dict, ref: dict, layout_dir: Path, ref_dir: Path) -> None:
    """Fill in the row from the job's outcomes of the layout and its reference, and their comparison."""
    row.seconds = mine.get("seconds", 0.0)
    if not mine["ok"]:
        row.error = mine["error"]
    elif not ref["ok"]:
        row.error = f"its reference run failed: {ref['error']}"
    else:
        check = compare_learning if row.layout.bf16 else compare
        try:
            row.result = check(layout_dir, ref_dir, row.describe)
        except (OSError, RuntimeError, ValueError) as e:
            row.error = f"{type(e).__name__}: {e}"
        if row.layout.resumes and row.result and row.result.steps != STEPS - RESUME_AT:
            row.error = f"ran {row.result.steps} steps: it did not resume from step {RESUME_AT}"
