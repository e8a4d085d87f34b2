"""A run's pictures, drawn from its directory: the measured timeline (trace.json), the planned pipeline schedule
(config.yaml, through the simulator) and the mesh with each group's traffic (comm_ledger.json)."""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from . import ledger
from .config import PICTURES, Config, load_saved_config
from .files import written
from .mesh import GROUP_DIMS, GROUP_NAMES, ORDER, ParallelDims
from .parallel.pipeline import schedules
from .parallel.pipeline.simulate import simulate
from .parallel.pipeline.stages import split_stages, stage_costs
from .trace import read_chrome_trace

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B2", "optim": "#C44E52", "comm": "#DD8452", "data": "#937860"}
GAP = 0.6  # between blocks of the mesh grid, in rank boxes
LEGEND = 8  # the groups a mesh panel's legend names; more are summed up in one line
SOURCES = ("config.yaml", "trace.json", "comm_ledger.json")  # what they are drawn from


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def draw_pictures(run_dir: str | Path, cfg: Config | None = None, failed: list[str] | None = None) -> list[Path]:
    """Every picture the run directory has the files for; returns the paths written. With `failed`, a picture that
    cannot be drawn (but for an OSError: no room, no access) is said there, and the others are drawn."""
    run_dir = Path(run_dir)
    cfg = cfg or load_saved_config(run_dir / "config.yaml")
    p, written = cfg.parallel, []
    layout = p.describe()  # the files an earlier launch of another layout left are refused
    events = read_chrome_trace(run_dir / "trace.json", layout) if (run_dir / "trace.json").is_file() else []
    pictures = []  # (name, what draws it)
    if events:
        steps = sorted({e["args"]["step"] for e in events})
        pictures.append((PICTURES[0], lambda: draw_timeline(
            events, run_dir / PICTURES[0], f"sixfold {layout}: steps {steps[0]}-{steps[-1]} of {cfg.train.steps}")))
    if p.pp > 1:
        pictures.append((PICTURES[1], lambda: draw_schedule(cfg, run_dir / PICTURES[1])))
    if (run_dir / "comm_ledger.json").is_file():
        data = ledger.read(run_dir, layout)
        pictures.append((PICTURES[2], lambda: draw_mesh(ParallelDims.from_config(p), data, run_dir / PICTURES[2],
                                                        f"sixfold {layout}")))
    for name, draw in pictures:
        try:
            written.append(draw())
        except OSError:
            raise
        except Exception as e:  # matplotlib's, or a bug here: said, when the caller asks, with the others drawn
            if failed is None:
                raise
            failed.append(f"{name} ({type(e).__name__}: {e})")
    return written


def draw_schedule(cfg: Config, path: Path) -> Path:
    """The run's pipeline schedule as the simulator plans it, each stage costing its FLOPs."""
    p = cfg.parallel
    s = schedules.build(p.pp_schedule, p.pp, p.pp_virtual_stages, cfg.train.micro_batches)
    stages = split_stages(cfg.model, s.stages, cfg.train.seq_len)
    plan = simulate(s, stage_costs(cfg.model, stages, cfg.train.seq_len, s.splits))
    return draw_timeline(schedule_events(plan), path, f"{s.name} pp={s.pp} v={s.v} m={s.m}, as planned (simulator; "
                         f"bubble {plan.bubble:.0%} on average)",
                         "time (1 = the mean stage's forward; each stage costs its FLOPs)", "pp rank")


# the timeline -----------------------------------------------------------------------------------

def _color(e: dict) -> str:
    if e["cat"] == "comm":
        return COLORS["comm"]
    return COLORS.get(e["cat"], COLORS.get(e["name"][:1], "#999999"))


def draw_timeline(events: list[dict], path: Path, title: str, xlabel: str = "time (ms)", row: str = "rank") -> Path:
    """Ranks x time: compute spans above, communication below, one lane each per rank (rows named `row` N)."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    ranks = sorted({e["pid"] for e in events})
    place = {r: i for i, r in enumerate(ranks)}  # each rank's row
    t0 = min(e["ts"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - t0
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(ranks) + 1.5))
    bars = defaultdict(list)  # (lane, colour, edge) -> spans: one collection each, drawn much faster
    for e in events:
        y = place[e["pid"]] + (0.05 if e["tid"] == 0 else -0.4)
        bars[y, _color(e), "white" if "mb" in e["args"] else "none"].append(
            ((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.05)))
        if "stage" in e["args"] and e["dur"] > span / 80:  # a pipeline action wide enough: its micro-batch
            ax.text((e["ts"] - t0 + e["dur"] / 2) / 1e3, y + 0.175, str(e["args"]["mb"]), ha="center",
                    va="center", fontsize=6, color="white")
    for (y, colour, edge), spans in bars.items():
        ax.broken_barh(spans, (y, 0.35), facecolors=colour, edgecolors=edge, linewidth=0.5)
    ax.set_yticks(range(len(ranks)), [f"{row} {r}" for r in ranks])
    ax.set_ylim(-0.6, len(ranks) - 0.35)  # a rank's lanes from -0.4 to 0.4: no margin growing with the ranks
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fig.tight_layout()
    below = 0.6 / (ax.get_position().height * fig.get_figheight())  # 0.6 inch under the axes, past the x label
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -below), ncol=6, fontsize=8, frameon=False)
    with written(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


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


# the mesh ---------------------------------------------------------------------------------------

def grid(dims: ParallelDims) -> tuple[dict[int, tuple[float, float]], str]:
    """Each rank's place in the picture, and a caption. The dimensions of size > 1, innermost (tp) first, go
    alternately across and down; each outer one repeats the block of the inner ones, with a gap."""
    active = [d for d in ORDER if getattr(dims, d) > 1]
    axes = active[0::2], active[1::2]
    places = {}
    for rank in range(dims.world_size):
        c, xy = dims.coords(rank), []
        for names in axes:
            at, span = 0.0, 1.0
            for d in names:
                at += c[d] * span
                span = span * getattr(dims, d) + GAP
            xy.append(at)
        places[rank] = (xy[0], -xy[1])
    caption = f"across: {', then '.join(axes[0]) or '-'};  down: {', then '.join(axes[1]) or '-'}"
    return places, caption


def _size(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:,.0f} {unit}" if unit == "B" else f"{b:,.1f} {unit}"
        b /= 1024


def _arc(a: tuple[float, float], z: tuple[float, float]):
    """The line between the boxes at a and z: a quadratic curve (matplotlib's arc3) whose middle passes rad / 2 of
    their distance off the straight line, bowing around the boxes between by at most 0.6 of a box, so that a long
    one (ranks far apart on a large mesh) stays in its panel rather than cross the legend below it."""
    from matplotlib.path import Path as Curve
    rad = min(0.3, 1.2 / math.dist(a, z))
    (x1, y1), (x2, y2) = a, z
    control = ((x1 + x2) / 2 + rad * (y2 - y1), (y1 + y2) / 2 - rad * (x2 - x1))
    return Curve([a, control, z], [Curve.MOVETO, Curve.CURVE3, Curve.CURVE3])


def _ranks(group: tuple[int, ...]) -> str:
    """A group's ranks as a legend gives them: all of a few, the first two and the last of many."""
    if len(group) <= 6:
        return ",".join(map(str, group))
    return f"{group[0]},{group[1]},...,{group[-1]} ({len(group)} ranks)"


def _legend(groups: list[tuple[int, ...]], sizes: list[float]) -> list[str]:
    """A panel's legend: each group's ranks and bytes per step; past LEGEND + 1 groups, the first LEGEND and one line
    for the others (a large mesh would otherwise list hundreds, past the panel)."""
    rows = [f"ranks {_ranks(g)}: {_size(b)}" for g, b in zip(groups, sizes)]
    if len(rows) <= LEGEND + 1:
        return rows
    rest = sizes[LEGEND:]
    span = _size(min(rest)) if min(rest) == max(rest) else f"{_size(min(rest))} to {_size(max(rest))}"
    return rows[:LEGEND] + [f"and {len(rest)} more groups: {span} each"]


def draw_mesh(dims: ParallelDims, data: dict, path: Path, title: str) -> Path:
    """One panel per kind of group that carried traffic: the ranks on the grid, each group in its own colour,
    its members joined by a line as thick as its bytes per training step; each rank shows its own."""
    plt = _pyplot()
    from matplotlib.collections import PatchCollection, PathCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    places, caption = grid(dims)
    per_step = {int(r): ledger.mean_per_step(part) for r, part in data["ranks"].items()}

    def sent(rank: int, kind: str) -> float:
        return sum(t["bytes"] for key, t in per_step.get(rank, {}).items() if key.split("/")[0] == kind)

    kinds = [k for k in GROUP_NAMES if any(sent(r, k) for r in places)]
    groups = {k: [g for g in dims.all_groups(k) if len(g) > 1] for k in kinds}
    heaviest = max((sum(sent(r, k) for r in g) for k in kinds for g in groups[k]), default=0) or 1
    xs, ys = [x for x, _ in places.values()], [y for _, y in places.values()]
    w, h = max(xs) - min(xs) + 1.2, max(ys) - min(ys) + 1.2
    panel_w, panel_h = max(3.2, 0.95 * w), max(1.6, 0.95 * h) + 1.6  # the legend below
    cols = max(1, min(len(kinds), 3, int(20 // panel_w)))
    rows = max(1, math.ceil(len(kinds) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(cols * panel_w, rows * panel_h), squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.set_axis_off()
    for ax, kind in zip(axes.flat, kinds):  # boxes and lines as one artist each: a large mesh has thousands
        colour, sizes, arcs, arc_colours, widths = {}, [], [], [], []
        for i, g in enumerate(groups[kind]):
            c, b = plt.cm.tab10(i % 10), sum(sent(r, kind) for r in g)
            colour.update({r: c for r in g})
            sizes.append(b)
            arcs += [_arc(places[a], places[z]) for a, z in zip(g, g[1:])]
            arc_colours += [c] * (len(g) - 1)
            widths += [1 + 7 * b / heaviest] * (len(g) - 1)
        ax.add_collection(PathCollection(arcs, facecolors="none", edgecolors=arc_colours, linewidths=widths,
                                         alpha=0.8, zorder=2))
        labels = _legend(groups[kind], sizes)
        handles = [Line2D([], [], color=plt.cm.tab10(i % 10), lw=3, label=label) for i, label in enumerate(labels)]
        if len(labels) < len(sizes):  # the last line sums up the other groups: no colour of its own
            handles[-1].set_color("none")
        boxes = [Rectangle((x - 0.35, y - 0.35), 0.7, 0.7) for x, y in places.values()]
        ax.add_collection(PatchCollection(boxes, facecolors=[colour.get(r, "#dddddd") for r in places], alpha=0.9,
                                          edgecolors="black", linewidths=0.6, zorder=3))
        for r, (x, y) in places.items():  # inside the panel: left out of the layout's measuring
            ax.text(x, y + 0.12, str(r), ha="center", va="center", fontsize=9, weight="bold", zorder=4,
                    in_layout=False)
            if r in colour:
                ax.text(x, y - 0.18, _size(sent(r, kind)), ha="center", va="center", fontsize=6, zorder=4,
                        in_layout=False)
        ops = sorted({key.split("/")[1] for part in per_step.values() for key in part if key.split("/")[0] == kind})
        within = f" ({' x '.join(GROUP_DIMS[kind])})" if kind in GROUP_DIMS and len(GROUP_DIMS[kind]) > 1 else ""
        ax.set_title(f"{kind}{within}\n{', '.join(ops)}", fontsize=9)  # two lines: panels sit close
        ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
        ax.set_ylim(min(ys) - 0.7, max(ys) + 0.7)
        ax.set_aspect("equal")
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0), fontsize=6.5, frameon=False,
                  ncol=2 if len(handles) > 4 else 1, title="bytes per step, summed over a group's ranks",
                  title_fontsize=6.5)
    if not kinds:
        axes[0, 0].text(0.5, 0.5, "no communication", ha="center", va="center", transform=axes[0, 0].transAxes)
    fig.suptitle(f"{title}: each group's bytes per training step (ledger)\nranks {caption}. A box: a rank and its "
                 f"bytes in that kind of group; a line: a group, as thick as its bytes", fontsize=9)
    with written(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
