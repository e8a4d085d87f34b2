"""Per-rank events (compute and communication spans) -> Chrome trace JSON and timeline pictures: the measured
one, and a pipeline schedule's plan from the simulator."""
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


COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B2", "optim": "#C44E52", "comm": "#DD8452", "data": "#937860"}


def _color(e: dict) -> str:
    if e["cat"] == "comm":
        return COLORS["comm"]
    return COLORS.get(e["cat"], COLORS.get(e["name"][:1], "#999999"))


def draw_timeline(events: list[dict], path: Path, title: str, xlabel: str = "time (ms)") -> None:
    """Ranks x time: compute spans above, communication below, one lane each per rank."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({e["pid"] for e in events})
    t0 = min(e["ts"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - t0
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(ranks) + 1.5))
    for i, rank in enumerate(ranks):
        for e in (e for e in events if e["pid"] == rank):
            y = i + (0.05 if e["tid"] == 0 else -0.4)
            ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.05))], (y, 0.35),
                           facecolors=_color(e), edgecolors="white" if "mb" in e["args"] else "none", linewidth=0.5)
            if "stage" in e["args"] and e["dur"] > span / 80:  # a pipeline action wide enough: its micro-batch
                ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, y + 0.175, str(e["args"]["mb"]), ha="center",
                        va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.12 - 0.2 / len(ranks)), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def schedule_events(simulation) -> list[dict]:
    """A simulated schedule's actions as events for draw_timeline (a time unit as 1000 of the trace's us)."""
    out = []
    for rank, stats in enumerate(simulation.ranks):
        for start, end, a in stats.events:
            compute = a.kind in ("F", "B", "W")
            out.append({"name": a.kind if compute else "comm", "cat": "compute" if compute else "comm",
                        "ts": start * 1e3, "dur": (end - start) * 1e3, "pid": rank, "tid": 0 if compute else 1,
                        "args": {"mb": a.micro, "stage": a.stage}})
    return out
