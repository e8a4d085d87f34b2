"""What bench/vs_torchtitan.py and bench/vs_deepspeed.py share: issue #11's workload run by sixfold and by another
framework (in a Python of its own) on this machine, each way of each row once a round, the two sides in turn, and
the table of their step times and peak memory.

Both sides are timed alike: rank 0's mean wall time per step over steps WARMUP + 1 to the last, from step to step
(the loop's own work between steps in); memory is each rank's resident-set growth from just before the model is
built (sixfold.measure's mark_memory and peak_mb, which the other side's runner imports too).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

from common import spread
from sixfold.bench import (TABLE, WARMUP, Layout, cores_per, least_disturbed, threads_per_rank, undisturbed_run,
                           workload_config)
from sixfold.measure import DOC, machine, write_doc

SKIPPED = 3  # the exit status without the other framework's Python (bench/run_all.py reports the section as skipped)


def arguments(doc: str, peer: str, env: str, rows: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--python", default=os.environ.get(env),
                   help=f"a Python with {peer} (default: ${env}); the script's docstring installs one")
    p.add_argument("--runs", type=int, default=3, help="rounds over the layouts")
    p.add_argument("--steps", type=int, default=10, help=f"steps per run; the first {WARMUP} are not timed")
    p.add_argument("--only", nargs="+", choices=rows, metavar="LAYOUT",
                   help="these rows only (the table's names: '1 process', 'dp 2', ...)")
    p.add_argument("--write", action="store_true", help="put the table into docs/benchmarks.md")
    args = p.parse_args()
    if args.steps <= WARMUP:
        p.error(f"--steps must be more than the {WARMUP} warm-up steps")
    return args


def version(python: str | None, package: str, env: str, script: str) -> str:
    """The package's version in that Python; without one, says what to give and exits with SKIPPED."""
    if not python:
        print(f"skipped: give --python (or set {env}) to a Python with {package}; see {script}'s docstring for the "
              f"one line that installs it")
        sys.exit(SKIPPED)
    found = subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version('{package}'))"],
                           text=True, capture_output=True)
    if found.returncode:
        sys.exit(f"{python} cannot import {package}: {found.stderr.strip()[-300:]}")
    return found.stdout.strip()


def sharded(layout: Layout, zero: int) -> tuple[str, ...]:
    """The row's overrides with its data parallelism sharded (dp_shard) at ZeRO stage `zero`."""
    return (*(o.replace("dp_replicate", "dp_shard") for o in layout.overrides), f"parallel.zero={zero}")


def sixfold_ways(layout: Layout, others: list[tuple[str, tuple[str, ...]]], steps: int) -> list[tuple]:
    """("sixfold", way, config) of the table's own way of the row (named "") and of `others` (name, overrides)."""
    return [("sixfold", way, workload_config(None, list(o), steps)) for way, o in [("", layout.overrides), *others]]


def peer_env(ranks: int, **extra: str) -> dict[str, str]:
    """The environment of the other side's job of `ranks` ranks: OMP_NUM_THREADS as sixfold's (the cores over the
    ranks), no GPU."""
    return {**os.environ, "OMP_NUM_THREADS": str(cores_per(ranks)), "CUDA_VISIBLE_DEVICES": "", **extra}


def sixfold_run(cfg) -> dict:
    """A sixfold job timed as the other side is: from step to step."""
    r = undisturbed_run(cfg, str(threads_per_rank(cfg)))
    return {**r, "step_s": r["wall_s"]}


def rounds(ways: dict[str, list[tuple]], runs: int, peer_run: Callable[[object], dict]) -> dict:
    """Each row's ways ((side, way, how): sixfold's config or what peer_run takes) run once a round, in turn (who
    goes first alternates), each side's run as least_disturbed runs it; {row: {(side, way): [result of each
    round]}}."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # sixfold's jobs on the CPU too, as the workload's
    rows = {name: {(side, way): [] for side, way, _ in ws} for name, ws in ways.items()}
    for i in range(runs):
        for name, ws in ways.items():
            for side, way, how in ws[::1 if i % 2 == 0 else -1]:
                r = sixfold_run(how) if side == "sixfold" else least_disturbed(lambda: peer_run(how))
                rows[name][side, way].append(r)
                print(f"round {i + 1}, {name}, {side} {way}: {r['step_s']:.3f} s/step, other processes "
                      f"{r['others']:.2f} cores", flush=True)
    return rows


def median(runs: list[dict]) -> float:
    return statistics.median(r["step_s"] for r in runs)


def peak(runs: list[dict]) -> float:
    """The median over runs of the largest rank's peak MB."""
    return statistics.median(max(r["peak_mb"]) for r in runs)


def cell(row: dict, side: str, value: Callable[[list[dict]], str]) -> str:
    return ", ".join(f"{value(runs)}{f' ({way})' if way else ''}" for (s, way), runs in row.items() if s == side)


@dataclass(frozen=True)
class Peer:
    name: str  # its side's name in the results and the table: "torchtitan"
    version: str  # as installed in its Python
    script: str  # the comparison's file under bench/
    column: int  # its column of the fixed times (Layout.peers)
    not_run: dict[str, str]  # the rows of TABLE it cannot run, and why
    note: str  # the section's words on what each side's ways of a row are, and where they differ


def report(rows: dict, args, rev: str, peer: Peer) -> str:
    """The section's body: how it was run and a row per layout of TABLE run or not run."""
    others = max(r["others"] for row in rows.values() for runs in row.values() for r in runs)
    name = peer.name
    lines = [f"Command: `python bench/{peer.script} {' '.join(sys.argv[1:])}`  ",
             f"Machine: {machine()}  ",
             f"sixfold: {rev}; {name} {peer.version}  ",
             f"Date: {time.strftime('%Y-%m-%d')}; {args.runs} round(s) over the layouts, each way of each layout "
             f"run once a round, sixfold's and {name}'s in turn (who goes first alternates); steps "
             f"{WARMUP + 1}-{args.steps} timed; other processes kept at most {others:.2f} cores busy in the runs "
             f"kept.",
             "",
             f"Seconds per step, median over runs (range); lower is better. {peer.note} Where a side has several "
             f"ways of a row, \"sixfold / {name}\" divides the fastest of sixfold's by the fastest of {name}'s; "
             "paired: each round's run of the one over the other's, median (range). Peak MB: the largest rank's "
             "resident-set growth from just before the model is built (file-backed pages left out), median over "
             f"runs; its ratio is of the ways the time ratio compares. The last column is {name} as issue #11 gives "
             "it.",
             "",
             f"| layout | sixfold | {name} here | sixfold / {name} | paired | sixfold peak MB | {name} peak MB | "
             f"memory ratio | {name}, issue #11 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for layout in TABLE:
        given = layout.peers[peer.column]
        if layout.name in peer.not_run:
            lines.append(f"| {layout.name} | - | not run: {peer.not_run[layout.name]} | - | - | - | - | - | {given} |")
            continue
        if layout.name not in rows:
            continue
        row = rows[layout.name]
        ours, theirs = (min((k for k in row if k[0] == side), key=lambda k: median(row[k]))
                        for side in ("sixfold", name))
        pairs = [a["step_s"] / b["step_s"] for a, b in zip(row[ours], row[theirs])]
        times, mbs = (lambda runs: spread([r["step_s"] for r in runs], 3)), (lambda runs: f"{peak(runs):.0f}")
        lines.append(f"| {layout.name} | {cell(row, 'sixfold', times)} | {cell(row, name, times)} | "
                     f"**{median(row[ours]) / median(row[theirs]):.2f}** | {spread(pairs, 2)} | "
                     f"{cell(row, 'sixfold', mbs)} | {cell(row, name, mbs)} | "
                     f"{peak(row[ours]) / peak(row[theirs]):.2f} | {given} |")
    return "\n".join(lines)


def publish(rows: dict, args, rev: str, peer: Peer) -> None:
    """Print the section and, with --write, put it into docs/benchmarks.md (markers named after the peer)."""
    body = report(rows, args, rev, peer)
    print(body)
    if args.write:
        write_doc(peer.name.lower(), f"The common workload: sixfold beside {peer.name}, both run here", body)
        print(f"wrote {DOC}")
