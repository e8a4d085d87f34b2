"""The communication ledger: payload bytes and calls per (group, op), per training step and per run, and the
file `comm_ledger.json` that holds every rank's."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .files import write_text

Traffic = dict[str, dict[str, int]]  # "group/op" -> {"bytes": ..., "calls": ...}


class Ledger:
    """Counts every collective. Traffic since the last close is a training step's (end_step) or belongs to a
    phase outside the steps (close: "eval", "sample", "other")."""

    def __init__(self):
        self.total: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.open_bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.open_calls: dict[tuple[str, str], int] = defaultdict(int)
        self.steps: list[dict] = []  # runs of consecutive steps with the same traffic: first, last, comm
        self.phases: dict[str, Traffic] = {}

    def record(self, group: str, op: str, nbytes: int) -> None:
        key = group, op
        self.total[key] += nbytes
        self.calls[key] += 1
        self.open_bytes[key] += nbytes
        self.open_calls[key] += 1

    def _take(self) -> Traffic:
        out = {f"{g}/{op}": {"bytes": b, "calls": self.open_calls[g, op]}
               for (g, op), b in sorted(self.open_bytes.items())}
        self.open_bytes.clear()
        self.open_calls.clear()
        return out

    def _add(self, phase: str, traffic: Traffic) -> None:
        into = self.phases.setdefault(phase, {})
        for key, t in traffic.items():
            have = into.setdefault(key, {"bytes": 0, "calls": 0})
            have["bytes"] += t["bytes"]
            have["calls"] += t["calls"]

    def end_step(self, step: int) -> int:
        """Close training step `step`; returns its bytes."""
        comm = self._take()
        self._add("train", comm)
        last = self.steps[-1] if self.steps else None
        if last and last["last"] == step - 1 and last["comm"] == comm:
            last["last"] = step
        else:
            self.steps.append({"first": step, "last": step, "comm": comm})
        return sum(t["bytes"] for t in comm.values())

    def close(self, phase: str) -> None:
        """What was counted since the last close belongs to `phase`."""
        traffic = self._take()
        if traffic:
            self._add(phase, traffic)

    def summary(self) -> dict:
        """This rank's part of comm_ledger.json."""
        total = {f"{g}/{op}": {"bytes": b, "calls": self.calls[g, op]} for (g, op), b in sorted(self.total.items())}
        return {"total": total, "phases": self.phases, "steps": self.steps}


# the file ---------------------------------------------------------------------------------------

def write(path: Path, parts: list[dict], layout: str) -> dict:
    """Every rank's summary (in rank order) as comm_ledger.json; returns what was written."""
    data = {"layout": layout, "ranks": {str(r): part for r, part in enumerate(parts)}}
    write_text(path, json.dumps(data, indent=1))
    return data


def _is_count(value) -> bool:
    """Whether value is a byte or call count: a number, not a boolean."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_traffic(traffic) -> bool:
    """Whether `traffic` is a Traffic: "group/op" -> {"bytes": ..., "calls": ...}."""
    return isinstance(traffic, dict) and all(
        key.count("/") == 1 and isinstance(t, dict) and _is_count(t.get("bytes")) and _is_count(t.get("calls"))
        for key, t in traffic.items())


def _is_run(run) -> bool:
    """Whether `run` is one of a rank's runs of steps: first, last (not before it), comm."""
    return (isinstance(run, dict) and isinstance(run.get("first"), int) and isinstance(run.get("last"), int)
            and 1 <= run["first"] <= run["last"] and _is_traffic(run.get("comm")))


def _part_problem(part) -> str | None:
    """What one rank's part lacks that the table and pictures read, in words, or None."""
    if not isinstance(part, dict):
        return "is not an object"
    if not _is_traffic(part.get("total")):
        return "has no 'total' traffic (\"group/op\": {bytes, calls})"
    if not isinstance(part.get("phases"), dict) or not all(map(_is_traffic, part["phases"].values())):
        return "has no 'phases' object of traffic"
    if not isinstance(part.get("steps"), list) or not all(map(_is_run, part["steps"])):
        return "has no 'steps' list of {first, last, comm} (1 <= first <= last)"
    return None


def _problem(data) -> str | None:
    """What comm_ledger.json's data lacks, in words, or None."""
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), dict):
        return "no 'ranks' object"
    for rank, part in data["ranks"].items():
        if not rank.isdigit():
            return f"rank {rank!r}, not a number"
        if problem := _part_problem(part):
            return f"rank {rank}'s part {problem}"
    return None


def read(run_dir: str | Path, layout: str | None = None) -> dict:
    """comm_ledger.json of a run directory, refused by name when it is not one that write made (or, given the
    `layout` the run's config.yaml describes, when a launch of another layout wrote it)."""
    path = Path(run_dir) / "comm_ledger.json"
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not a ledger sixfold wrote ({e}); train the run again to rewrite it") from None
    if problem := _problem(data):
        raise ValueError(f"{path} is not a ledger sixfold wrote ({problem}); train the run again to rewrite it")
    check_layout(path, data.get("layout"), layout)
    return data


def check_layout(path: Path, written: str | None, layout: str | None) -> None:
    """Refuse a run's summary file that a launch of another layout than the run's config.yaml wrote: an earlier
    launch's, beside the config of a later one that ended before writing its own."""
    if layout and written and written != layout:
        raise ValueError(f"{path} is an earlier launch's, in {written}; the run's config.yaml is a later launch's, in "
                         f"{layout}, which ended before writing its own: go on with the run to its end (it rewrites "
                         f"{path.name}), or remove {path.name}")


def step_traffic(part: dict, step: int) -> Traffic:
    """One rank's traffic in training step `step` (empty if the step is not in the ledger)."""
    for run in part["steps"]:
        if run["first"] <= step <= run["last"]:
            return run["comm"]
    return {}


def mean_per_step(part: dict) -> dict[str, dict[str, float]]:
    """One rank's bytes and calls per training step, averaged over its steps."""
    n = sum(run["last"] - run["first"] + 1 for run in part["steps"])
    return {key: {"bytes": t["bytes"] / n, "calls": t["calls"] / n}
            for key, t in part["phases"].get("train", {}).items()} if n else {}


def table(data: dict) -> str:
    """The summary printed at the end of a run: every (group, op), summed over ranks."""
    ranks = data["ranks"].values()
    steps = max((sum(r["last"] - r["first"] + 1 for r in part["steps"]) for part in ranks), default=0)
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for part in ranks:
        for key, t in mean_per_step(part).items():
            rows[key][0] += t["bytes"]
            rows[key][1] += t["calls"]
        for key, t in part["total"].items():
            rows[key][2] += t["bytes"]
    runs = [run for part in ranks for run in part["steps"]]
    span = f"steps {min(r['first'] for r in runs)}-{max(r['last'] for r in runs)}" if runs else "no training step"
    lines = [f"communication ledger, {len(ranks)} rank(s) summed; per step: mean over {steps} training step(s); "
             f"total: this run's, {span} and all else (evaluation, setup, checkpoints, the sample)",
             f"{'group':<14}{'op':<16}{'bytes/step':>16}{'calls/step':>12}{'total bytes':>18}"]
    for key, (per_step, calls, total) in sorted(rows.items()):
        group, op = key.split("/")
        lines.append(f"{group:<14}{op:<16}{per_step:>16,.0f}{calls:>12,.1f}{total:>18,}")
    return "\n".join(lines if rows else lines[:1] + ["no communication"])
