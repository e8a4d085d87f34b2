"""Per-rank events (compute and communication spans) -> Chrome trace JSON (pictures of them: pictures.py)."""
from __future__ import annotations

import json
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch.distributed as dist

ROWS = {"compute": 0, "comm": 1, "optim": 0, "data": 0}


def now_us() -> float:
    return time.time_ns() / 1000.0


class Tracer:
    """Records spans when enabled; costs one attribute check when not."""

    def __init__(self, enabled: bool, rank: int):
        self.enabled, self.rank = enabled, rank
        self.events: list[dict] = []
        self.step = 0

    def add(self, name: str, cat: str, start: float, end: float, **args) -> None:
        if self.enabled:
            self.events.append({"name": name, "cat": cat, "ts": start, "dur": max(end - start, 0.0),
                                "pid": self.rank, "tid": ROWS.get(cat, 0), "args": {"step": self.step, **args}})

    @contextmanager
    def _span(self, name: str, cat: str, args: dict):
        start = now_us()
        try:
            yield
        finally:
            self.add(name, cat, start, now_us(), **args)

    def span(self, name: str, cat: str = "compute", **args):
        return self._span(name, cat, args) if self.enabled else nullcontext()

    def gather(self, world: dist.ProcessGroup | None) -> list[dict]:
        """All the events of the run's ranks (`world`; None: this rank alone) on rank 0, an empty list elsewhere."""
        if world is None:
            return list(self.events)
        out = [None] * dist.get_world_size(world) if self.rank == 0 else None
        dist.gather_object(self.events, out, dst=0, group=world)
        return [e for part in out for e in part] if self.rank == 0 else []


def write_chrome_trace(events: list[dict], path: Path) -> None:
    """One process track per rank, compute and communication on separate rows (opens in Perfetto)."""
    t0 = min((e["ts"] for e in events), default=0.0)
    out = []
    for rank in sorted({e["pid"] for e in events}):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for row, label in ((0, "compute"), (1, "communication")):
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": row, "args": {"name": label}})
    out += [{**e, "ph": "X", "ts": e["ts"] - t0} for e in events]
    path.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(events: list[dict]) -> dict[str, dict[int, tuple[float, float]]]:
    """Per group and rank, over the traced steps: ms in flight of its asynchronous collectives (issue to completion,
    or to the end of the wait when the backend does not report completion earlier: then an upper bound) and the
    share of it hidden, that is not spent blocked in wait(). Synchronous collectives are left out: the compute
    that calls them waits for all of their time."""
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for rank in sorted({e["pid"] for e in events}):
        spans: dict[str, list] = {}
        waited: dict[str, float] = {}
        for e in events:
            if e["pid"] == rank and e["cat"] == "comm" and e["args"].get("async"):
                group = e["args"]["group"]
                spans.setdefault(group, []).append((e["ts"], e["ts"] + e["dur"]))
                waited[group] = waited.get(group, 0.0) + e["args"].get("waited_us", 0.0)
        for group, parts in spans.items():
            total = sum(b - a for a, b in _union(parts))
            out.setdefault(group, {})[rank] = (total / 1000, max(0.0, 1 - waited[group] / total) if total else 1.0)
    return out


def overlap_table(events: list[dict]) -> str:
    rows = ["asynchronous communication hidden behind compute (traced steps; per rank: ms in flight, share not "
            "spent waiting)"]
    for group, ranks in sorted(overlap(events).items()):
        cells = ", ".join(f"r{r} {ms:.1f} ms {share:.0%}" for r, (ms, share) in sorted(ranks.items()))
        total = sum(ms for ms, _ in ranks.values())
        hidden = sum(ms * share for ms, share in ranks.values()) / total if total else 1.0
        rows.append(f"  {group:<13} {hidden:4.0%} of {total:.1f} ms | {cells}")
    return "\n".join(rows)


def read_chrome_trace(path: Path) -> list[dict]:
    """The events of a trace.json written above."""
    return [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
