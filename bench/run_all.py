"""Every side-by-side benchmark, one after another, each with the arguments that made its section of
docs/benchmarks.md; then a summary of their ratios at the top of docs/benchmarks.md.

    python bench/run_all.py                      # all of them: several hours on 2 cores
    python bench/run_all.py --only e2e pp        # some of them (names: --help)
    python bench/run_all.py --quick              # a smoke test: fewer runs and steps; docs/benchmarks.md is
                                                 # put back afterwards, the quick version kept in a temporary file
    python bench/run_all.py --summary            # run nothing, only the summary from the sections there

Each benchmark is its own process (python bench/NAME.py ..., or sixfold bench --table --write), which waits for a
quiet machine and writes its own section, as when run by hand. A benchmark that fails is reported and the others
still run; one comparing against a framework that is not installed (bench/vs_torchtitan.py without
TORCHTITAN_PYTHON, bench/vs_deepspeed.py without DEEPSPEED_PYTHON) is reported as skipped. The summary reads the
ratios back from the sections (their markdown tables), so it also covers the sections this invocation did not
rewrite, and says when each was measured.
Nothing here needs a GPU (bench/gpu.py, which does, is not run).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sixfold.measure import write_doc

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
SUMMARY = "summary"


@dataclass(frozen=True)
class Job:
    name: str  # for --only
    argv: tuple[str, ...]  # after `python`: the command that made the current section(s)
    quick: tuple[str, ...]  # the same for --quick
    sections: tuple[str, ...]  # the docs markers it writes


JOBS = (
    Job("dp", ("bench/dp.py", "--ranks", "2", "4", "--runs", "4", "--write"),
        ("bench/dp.py", "--ranks", "2", "--runs", "1", "--steps", "3", "--write"), ("dp",)),
    Job("fsdp", ("bench/fsdp.py", "--ranks", "2", "4", "--runs", "4", "--write"),
        ("bench/fsdp.py", "--ranks", "2", "--runs", "1", "--steps", "3", "--write"), ("fsdp",)),
    Job("tp", ("bench/tp.py", "--ranks", "2", "4", "--runs", "4", "--write"),
        ("bench/tp.py", "--ranks", "2", "--runs", "1", "--steps", "3", "--write"), ("tp",)),
    Job("pp", ("bench/pp.py", "--runs", "8", "--pp4", "--runs4", "4", "--schedules", "gpipe", "1f1b", "interleaved",
               "breadth-first", "zb-v", "--write"),
        ("bench/pp.py", "--runs", "1", "--schedules", "1f1b", "zb-v", "--write"), ("pp",)),
    Job("pp-early", ("bench/pp_early.py", "--write"),
        ("bench/pp_early.py", "--steps", "2", "--layouts", "pp=2, m=4", "--write"), ("pp-early",)),
    Job("e2e", ("bench/e2e.py", "--ranks", "1", "4", "8", "--runs", "3", "--write"),
        ("bench/e2e.py", "--ranks", "4", "8", "--runs", "1", "--steps", "3", "--write"), ("e2e",)),
    Job("tp-activations", ("bench/activations.py", "--tp", "1", "2", "4", "--write"),
        ("bench/activations.py", "--tp", "1", "2", "--write"), ("tp-activations",)),
    Job("cp-activations", ("bench/activations.py", "--cp", "1", "2", "4", "--write"),
        ("bench/activations.py", "--cp", "1", "2", "--write"), ("cp-activations",)),
    Job("cp", ("bench/cp.py", "--seq", "256", "512", "1024", "2048", "--cp", "2", "--write"),
        ("bench/cp.py", "--seq", "256", "--cp", "2", "--repeats", "1", "--write"), ("cp",)),
    Job("cp-documents", ("bench/cp.py", "--seq", "256", "1024", "2048", "--cp", "2", "--documents", "100", "--write"),
        ("bench/cp.py", "--seq", "256", "--cp", "2", "--repeats", "1", "--documents", "100", "--write"),
        ("cp-documents",)),
    Job("ep", ("bench/ep.py", "--ep", "1", "2", "4", "--runs", "3", "--steps", "8", "--write"),
        ("bench/ep.py", "--ep", "1", "2", "--runs", "1", "--steps", "3", "--write"), ("ep",)),
    Job("collectives", ("bench/collectives.py", "--ranks", "2", "4", "--write"),
        ("bench/collectives.py", "--ranks", "2", "--blocks", "1", "--write"), ("collectives",)),
    Job("overlap", ("bench/overlap.py", "--runs", "3", "--write"),
        ("bench/overlap.py", "--runs", "1", "--steps", "4", "--demo-steps", "4", "--write"), ("overlap",)),
    Job("workload", ("-m", "sixfold.cli", "bench", "--table", "--write", "--runs", "3"),
        ("-m", "sixfold.cli", "bench", "--table", "--write", "--steps", "3"), ("workload",)),
    Job("torchtitan", ("bench/vs_torchtitan.py", "--runs", "3", "--write"),
        ("bench/vs_torchtitan.py", "--runs", "1", "--steps", "3", "--only", "1 process", "--write"), ("torchtitan",)),
    Job("deepspeed", ("bench/vs_deepspeed.py", "--runs", "3", "--write"),
        ("bench/vs_deepspeed.py", "--runs", "1", "--steps", "3", "--only", "1 process", "--write"), ("deepspeed",)),
)
SKIPPED = 3  # a job's exit status when what it compares against is not installed (bench/peers.py's)


@dataclass(frozen=True)
class Ratios:
    """Where a section's ratios are: the table holding the columns, the row's label, what the ratio divides by."""
    title: str  # the summary's name for the section
    versus: str  # the denominator
    time: tuple[str, int] | None  # (column header, which of the columns of that header: 0 the first)
    memory: tuple[str, int] | None
    label: tuple[int, ...] = (0,)  # the cells that name a row
    last: bool = False  # only the rows whose first cell is the last row's (cp: the longest sequence)


COMPARISONS = {  # sixfold against another implementation
    "dp": Ratios("Data parallel", "DDP", ("time ratio", 0), ("memory ratio", 0)),
    "fsdp": Ratios("Fully sharded (ZeRO-3)", "FSDP2", ("time ratio", 0), ("memory ratio", 0)),
    "tp": Ratios("Tensor parallel (sequence-TP)", "DTensor TP+SP", ("time ratio", 0), ("memory ratio", 0)),
    "pp": Ratios("Pipeline parallel", "torch.distributed.pipelining", ("time ratio", 0), ("memory ratio", 0),
                 label=(1, 0)),
    "e2e": Ratios("End to end", "torch's parts composed as in torchtitan", ("time ratio", 0), ("memory ratio", 0)),
    "collectives": Ratios("Reduce-scatter on gloo", "torch.distributed.reduce_scatter_tensor", ("time ratio", 0),
                          None),
    "torchtitan": Ratios("Common workload, torchtitan run here", "torchtitan 0.3.0 in the same session (its faster "
                         "way where it has several)", ("sixfold / torchtitan", 0), ("memory ratio", 0)),
    "deepspeed": Ratios("Common workload, DeepSpeed run here", "DeepSpeed 0.19.8 in the same session (its faster "
                        "way)", ("sixfold / DeepSpeed", 0), ("memory ratio", 0)),
    "workload": Ratios("Common workload, 8 layouts", "fastest of picotron, torchtitan, DeepSpeed (their fixed times "
                       "from issue #11, on a CPU it does not name: not yet evidence, see the section)",
                       ("sixfold / fastest peer", 0), None),
}
WITHIN = {  # sixfold against itself at a baseline layout
    "tp-activations": Ratios("Saved activations under TP", "tp=1", None, ("total vs tp=1", 0)),
    "cp-activations": Ratios("Saved activations under CP", "cp=1", None, ("vs cp=1", 0)),
    "cp": Ratios("Context parallel, longest sequence", "cp=1 at the same length", ("vs cp=1", 0),
                 ("vs cp=1", 1), label=(0, 1), last=True),
    "cp-documents": Ratios("Attention within documents of 100 tokens", "causal over the whole sequence",
                           ("time ratio", 0), ("memory ratio", 0), label=(0, 1), last=True),
    "ep": Ratios("Expert parallel (MoE)", "ep=1", ("median vs first", 0), None),
    "pp-early": Ratios("Pipeline, input gradients sent first", "sent after the weight gradient", ("time ratio", 0),
                       None),
}


# ---- reading the sections back ----

def section(text: str, name: str) -> str | None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0]


def heading(text: str, name: str) -> str | None:
    """The title of the `## ` heading above the section's markers."""
    before = text.split(f"<!-- {name}:begin -->", 1)[0]
    titles = re.findall(r"^## (.+)$", before, flags=re.M)
    return titles[-1].strip() if titles else None


def anchor(title: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def tables(body: str) -> list[tuple[list[str], list[list[str]]]]:
    """The markdown tables of a section: (header cells, rows of cells), bold marks dropped."""
    found, lines = [], body.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1].strip()):
            cells = [[c.strip().strip("*").strip() for c in line.strip().strip("|").split("|")]
                     for line in lines[i:i + 2]]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip().strip("*").strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            found.append((cells[0], rows))
        else:
            i += 1
    return found


def column(header: list[str], which: tuple[str, int] | None) -> int | None:
    if which is None:
        return None
    hits = [i for i, h in enumerate(header) if h == which[0]]
    return hits[which[1]] if len(hits) > which[1] else None


def ratios(body: str, spec: Ratios) -> list[tuple[str, str, str]]:
    """(row label, time ratio, memory ratio) of each row of the first table with either column ('-' if none)."""
    for header, rows in tables(body):
        t, m = column(header, spec.time), column(header, spec.memory)
        if t is None and m is None:
            continue
        rows = [r for r in rows if len(r) == len(header)]
        if spec.last and rows:
            rows = [r for r in rows if r[0] == rows[-1][0]]
        return [(", ".join(r[i] for i in spec.label), r[t] if t is not None else "-", r[m] if m is not None else "-")
                for r in rows]
    return []


def measured(body: str) -> str:
    """When and on which commit a section was measured, from its Date: and sixfold: lines."""
    date = re.search(r"^Date: (\d{4}-\d{2}-\d{2})", body, flags=re.M)
    rev = re.search(r"^sixfold: commit (\w+)", body, flags=re.M)
    return ", ".join(x for x in (date and date[1], rev and f"commit {rev[1]}") if x) or "?"


def summary(text: str, status: dict[str, str], command: str) -> str:
    """The summary section's body: a row per section, its ratios per layout, and when it was measured; status:
    what this invocation did about a section (ran, failed, ...), absent for those it left alone."""
    out = [f"Written by `{command}` on {time.strftime('%Y-%m-%d')}. Ratios are sixfold / the other side: below 1, "
           "sixfold is faster or holds less memory. Each row links to its section, which has the command, the "
           "machine, the spread over runs and how the two sides were made equal; a ratio within that spread is a "
           "tie. On this 2-core machine, layouts of more than 2 ranks time-share the cores.", ""]
    for caption, specs in (("Against other implementations", COMPARISONS),
                           ("Within sixfold, against its own baseline layout", WITHIN)):
        out += [f"{caption}:", "", "| benchmark | divided by | time ratio | memory ratio | measured |",
                "|---|---|---|---|---|"]
        for name, spec in specs.items():
            body = section(text, name)
            title = heading(text, name) if body is not None else None
            link = f"[{spec.title}](#{anchor(title)})" if title else spec.title
            found = ratios(body, spec) if body is not None else []
            when = measured(body) if body is not None and found else "not measured yet"
            if name in status:
                when += f" ({status[name]})"
            if specs is WITHIN:  # the baseline's own row says nothing
                found = [row for row in found if any(v not in ("-", "1.00", "1.000") for v in row[1:])]
            times = "; ".join(f"{label} {t}" for label, t, _ in found if t != "-") or "-"
            memory = "; ".join(f"{label} {m}" for label, _, m in found if m != "-") or "-"
            out.append(f"| {link} | {spec.versus} | {times} | {memory} | {when} |")
        out.append("")
    return "\n".join(out).rstrip()


def write_summary(body: str, doc: Path = DOC) -> None:
    """Between the summary markers, or, the first time, in a section right under the page's title."""
    write_doc(SUMMARY, "Summary", body, doc, first=True)


# ---- running ----

def run(job: Job, quick: bool) -> str:
    """The job's status in the summary."""
    argv = [sys.executable, *(job.quick if quick else job.argv)]
    print(f"\n=== {job.name}: {' '.join(argv[1:])}", flush=True)
    began = time.perf_counter()
    # this checkout's sixfold, also for `sixfold bench`, which writes into the docs beside the package it runs
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
    code = subprocess.run(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}).returncode
    status = "written now" + (" with --quick" if quick else "") if code == 0 else \
        "skipped now: not installed; figures from before" if code == SKIPPED else "FAILED now; figures from before"
    print(f"=== {job.name}: {status.split(';')[0]} after {(time.perf_counter() - began) / 60:.1f} min", flush=True)
    return status


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=[j.name for j in JOBS], metavar="NAME",
                   help=f"run only these ({', '.join(j.name for j in JOBS)}); the summary still covers every section")
    p.add_argument("--quick", action="store_true", help="a smoke test: fewer runs, steps and layouts; "
                   "docs/benchmarks.md is restored afterwards and the quick version kept in a temporary file")
    p.add_argument("--summary", action="store_true", help="run nothing: only rewrite the summary from the sections")
    args = p.parse_args()
    jobs = [] if args.summary else [j for j in JOBS if not args.only or j.name in args.only]
    original = DOC.read_text()
    status, began = {}, time.perf_counter()
    try:
        for job in jobs:
            done = run(job, args.quick)
            for name in job.sections:
                status[name] = done
        body = summary(DOC.read_text(), status, "python bench/run_all.py " + " ".join(sys.argv[1:]))
        write_summary(body)
        print(f"\n{body}\n\n{len(jobs)} benchmark(s) in {(time.perf_counter() - began) / 60:.0f} min; failed: "
              f"{', '.join(j.name for j in jobs if 'FAILED' in status[j.sections[0]]) or 'none'}")
    finally:
        if args.quick:
            kept = Path(tempfile.mkstemp(prefix="benchmarks-quick-", suffix=".md")[1])
            kept.write_text(DOC.read_text())
            DOC.write_text(original)
            print(f"--quick: docs/benchmarks.md restored; the quick version is {kept}")
    if any("FAILED" in s for s in status.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
