"""Per-rank events (compute and communication spans) -> Chrome trace JSON (pictures of them: pictures.py)."""
from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

from .files import write_text
from .ledger import check_layout

ROWS = {"compute": 0, "comm": 1, "optim": 0, "data": 0}


def now_us() -> float:
    return time.time_ns() / 1000.0


class Tracer:
    """Records spans when enabled; costs one attribute check when not."""

    def __init__(self, enabled: bool, rank: int):
        self.enabled, self.rank = enabled, rank
        self.events: list[dict] = []
        self.step = 0

    def add(self, name: str, cat: str, start: float, end: float, step: int | None = None, **args) -> None:
        """A span of the current step if tracing; with `step`, of that step (traced when it began) in any case."""
        if self.enabled or step is not None:
            self.events.append({"name": name, "cat": cat, "ts": start, "dur": max(end - start, 0.0), "pid": self.rank,
                                "tid": ROWS.get(cat, 0), "args": {"step": self.step if step is None else step, **args}})

    @contextmanager
    def _span(self, name: str, cat: str, args: dict):
        start = now_us()
        try:
            yield
        finally:
            self.add(name, cat, start, now_us(), **args)

    def span(self, name: str, cat: str = "compute", **args):
        return self._span(name, cat, args) if self.enabled else nullcontext()


def _comm_lanes(events: list[dict]) -> list[int]:
    """A row for each event: compute on row 0; communication on rows 1, 2, ..., the first one free, so that
    collectives in flight together do not overlap on one row (trace viewers drop such slices)."""
    rows, ends = [0] * len(events), defaultdict(list)  # rank -> end time of each communication row
    for i in sorted(range(len(events)), key=lambda i: events[i]["ts"]):
        e = events[i]
        if e["tid"] == 0:
            continue
        lanes = ends[e["pid"]]
        free = next((k for k, end in enumerate(lanes) if end <= e["ts"]), len(lanes))
        if free == len(lanes):
            lanes.append(0.0)
        lanes[free] = e["ts"] + e["dur"]
        rows[i] = 1 + free
    return rows


def write_chrome_trace(events: list[dict], path: Path, layout: str) -> None:
    """One process track per rank, compute and communication on separate rows (opens in Perfetto); `layout`, the
    run's, kept beside them."""
    t0 = min((e["ts"] for e in events), default=0.0)
    rows = _comm_lanes(events)
    lanes: dict[int, int] = defaultdict(lambda: 1)  # rank -> its last communication row (once over the events)
    for e, row in zip(events, rows):
        lanes[e["pid"]] = max(lanes[e["pid"]], row)
    out = []
    for rank in sorted(lanes):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for row in range(lanes[rank] + 1):
            label = "compute" if row == 0 else "communication" + (f" {row}" if row > 1 else "")
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": row, "args": {"name": label}})
    out += [{**e, "ph": "X", "ts": e["ts"] - t0, "tid": row} for e, row in zip(events, rows)]
    write_text(path, json.dumps({"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"layout": layout}}))


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _counterpart(label: str) -> str | None:
    """The other end of a pipeline message: SEND_F(s0,m3) <-> RECV_F(s1,m3), SEND_B(s1,m3) <-> RECV_B(s0,m3)."""
    m = re.fullmatch(r"(SEND|RECV)_([FB])\(s(\d+),m(\d+)\)", label)
    if m is None:
        return None
    end, kind, stage, micro = m[1], m[2], int(m[3]), int(m[4])
    step = 1 if (end == "SEND") == (kind == "F") else -1
    return f"{'RECV' if end == 'SEND' else 'SEND'}_{kind}(s{stage + step},m{micro})"


def _messages(e: dict) -> list[str]:
    """The pipeline messages of a send_recv batch by label; none for other events (a cp ring's hop)."""
    labels = e["name"].split()[2:]
    ok = e["args"].get("op") == "send_recv" and labels and all(map(_counterpart, labels))
    return labels if ok else []


def _other_ends(asyncs: list[dict]) -> dict[int, list[dict | None]]:
    """id(event) -> for each pipeline message of a send_recv batch, the batch on a peer rank holding its other
    end (None where that is not traced)."""
    messages = {(e["args"]["step"], label, e["pid"]): e for e in asyncs for label in _messages(e)}
    out = {}
    for e in asyncs:
        a = e["args"]
        if labels := _messages(e):
            peers = [q for q in a.get("ranks", ()) if q != e["pid"]]
            out[id(e)] = [next((messages[k] for q in peers if (k := (a["step"], _counterpart(label), q)) in messages),
                               None) for label in labels]
    return out


def _joined(asyncs: list[dict], ends: dict[int, list[dict | None]]) -> dict[int, float]:
    """id(event) -> when the last rank it needs had posted its part: every rank taking part in a collective or a
    cp ring's hop (the k-th of that name and step on each), the other end of each message for pipeline sends and
    receives."""
    ordered = sorted(asyncs, key=lambda e: e["ts"])
    runs: dict[tuple, list[float]] = defaultdict(list)
    for e in ordered:
        if id(e) not in ends:
            runs[e["pid"], e["args"]["step"], e["name"], e["args"]["group"]].append(e["ts"])
    out, seen = {}, defaultdict(int)
    for e in ordered:
        a, ranks = e["args"], [q for q in e["args"].get("ranks", ()) if q != e["pid"]]
        if id(e) in ends:
            times = [o["ts"] for o in ends[id(e)] if o is not None]
        else:
            key = (a["step"], e["name"], a["group"])
            k = seen[(e["pid"], *key)]
            seen[(e["pid"], *key)] += 1
            times = [runs[(q, *key)][k] for q in ranks if len(runs[(q, *key)]) > k]
        out[id(e)] = max([e["ts"], *times])
    return out


def _received(asyncs: list[dict], ends: dict[int, list[dict | None]]) -> dict[int, float]:
    """id(event) -> when the peers' receives of a batch of pipeline sends completed (the latest), for the batches
    whose every receive is traced: a send is done by then, though the sender may wait for it later."""
    out = {}
    for e in asyncs:
        labels, others = e["name"].split()[2:], ends.get(id(e))
        if others and all(x.startswith("SEND_") for x in labels) and None not in others:
            out[id(e)] = max(o["ts"] + o["dur"] for o in others)
    return out


def _measure(spans: list[tuple[float, float]], within: list[tuple[float, float]]) -> float:
    """The time of the union of `spans` that lies in the union of `within`."""
    out, j, cut = 0.0, 0, _union(within)
    for a, b in _union(spans):
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < b:
            out += max(0.0, min(b, cut[k][1]) - max(a, cut[k][0]))
            k += 1
    return out


def overlap(events: list[dict]) -> dict[str, dict[int, tuple[float, float, float]]]:
    """Per group and rank, over the traced steps, of its asynchronous collectives: ms in flight, counted from when
    every rank taking part had posted it (from issue when the trace does not say) to completion, or to the end of
    the wait when the backend does not report completion earlier (then an upper bound; a pipeline send, waited
    for later, ends when its receive did); the share of it hidden behind compute: not spent blocked in
    communication, that is in wait() for any collective while that one was in flight (before, it waits for a slower
    rank; after its completion, wait() may still be summing a CPU reduce-scatter's slices: compute) or in a
    synchronous collective (from when every rank taking part had posted it: before, it waits for a slower rank, as
    the trace tells with `ranks`); and the ms blocked in its own wait() before the last peer posted it, which is waiting
    for a slower rank, not communication. Ranks on different machines are compared by their clocks. Synchronous
    collectives have no row: the compute that calls them waits for all of their time."""
    comm = [e for e in events if e["cat"] == "comm"]
    asyncs = [e for e in comm if e["args"].get("async")]
    ends = _other_ends(asyncs)
    joined, received = _joined(asyncs, ends), _received(asyncs, ends)
    spans: dict[tuple[str, int], list] = defaultdict(list)
    blocked: dict[int, list] = defaultdict(list)  # rank -> when it was blocked in communication
    unplaced: dict[tuple[str, int], float] = defaultdict(float)  # waits a trace does not place (no wait_after_us)
    peers: dict[tuple[str, int], float] = defaultdict(float)
    syncs = [e for e in comm if not e["args"].get("async")]
    posted = _joined([e for e in syncs if isinstance(e["args"].get("group"), str)], {})
    for e in syncs:  # blocked in it once every rank taking part had posted it
        since = posted.get(id(e), e["ts"])
        blocked[e["pid"]].append((since, max(since, e["ts"] + e["dur"])))
    for e in asyncs:
        key, a = (e["args"]["group"], e["pid"]), e["args"]
        start = max(e["ts"], joined[id(e)])
        end = max(start, min(e["ts"] + e["dur"], received.get(id(e), float("inf"))))
        spans[key].append((start, end))
        waited = a.get("waited_us", 0.0)
        if "wait_after_us" not in a:
            unplaced[key] += min(waited, end - start)
            continue
        wait_at = e["ts"] + a["wait_after_us"]
        # blocked on communication from when it is in flight; before, waiting for a slower rank (counted apart)
        blocked[e["pid"]].append((max(wait_at, start), max(wait_at, start, min(wait_at + waited, end))))
        peers[key] += max(0.0, min(wait_at + waited, start) - wait_at)
    out: dict[str, dict[int, tuple[float, float, float]]] = {}
    for (group, rank), parts in sorted(spans.items()):
        total = sum(b - a for a, b in _union(parts))
        exposed = min(total, _measure(parts, blocked[rank]) + unplaced[group, rank])
        share = max(0.0, 1 - exposed / total) if total else 1.0
        out.setdefault(group, {})[rank] = (total / 1000, share, peers[group, rank] / 1000)
    return out


def overlap_table(events: list[dict]) -> str:
    rows = ["asynchronous communication hidden behind compute (traced steps; per rank: ms in flight once every rank "
            "taking part had posted it, share not spent blocked in communication; apart: ms waiting for slower ranks "
            "to post)"]
    groups = overlap(events)
    if not groups:
        rows.append("  none traced")
    for group, ranks in sorted(groups.items()):
        cells = _rank_cells(ranks)
        total = sum(ms for ms, _, _ in ranks.values())
        hidden = sum(ms * share for ms, share, _ in ranks.values()) / total if total else 1.0
        late = sum(p for _, _, p in ranks.values())
        rows.append(f"  {group:<13} {hidden:4.0%} of {total:.1f} ms, {late:.1f} ms waiting for peers | {cells}")
    return "\n".join(rows)


CELLS = 8  # the ranks a row of the overlap table names; of more, those that hide the least and a summary


def _rank_cells(ranks: dict[int, tuple[float, float, float]]) -> str:
    """A group's ranks in the overlap table: each one, or of more than CELLS + 1 the CELLS that hide the least
    and one cell for the others' range (a row of 1024 ranks would run to 20,000 characters)."""
    def cell(r: int) -> str:
        return f"r{r} {ranks[r][0]:.1f} ms {ranks[r][1]:.0%}"
    if len(ranks) <= CELLS + 1:
        return ", ".join(map(cell, sorted(ranks)))
    least = sorted(ranks, key=lambda r: (ranks[r][1], r))
    rest = [ranks[r][1] for r in least[CELLS:]]
    return ", ".join(map(cell, sorted(least[:CELLS]))) + \
        f"; the {len(rest)} other ranks hide {min(rest):.0%} to {max(rest):.0%}"


SPAN = {"name": str, "cat": str, "ts": float, "dur": float, "pid": int, "tid": int, "args": dict}
WORDS = {str: "a string", int: "an integer", float: "a number", dict: "an object"}


def _fits(value, kind: type) -> bool:
    """Whether value is a `kind` (for float: any number); a boolean is none of them."""
    return not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else kind)


def _field_problem(fields: dict, need: dict[str, type], prefix: str = "") -> str | None:
    """The first of `need` that `fields` lacks or holds as another type, in words, or None."""
    for key, kind in need.items():
        if key not in fields:
            return f"no {prefix}{key}"
        if not _fits(fields[key], kind):
            return f"{prefix}{key}={fields[key]!r}, not {WORDS[kind]}"
    return None


def _span_problem(e: dict) -> str | None:
    """What a span lacks that the tables and pictures read, or None: its fields, its step, the group of an
    asynchronous collective, the micro-batch of a pipeline action; and what it holds of the optional ones in
    another type (a collective's ranks and waits)."""
    if problem := _field_problem(e, SPAN):
        return problem
    args = e["args"]
    need = {"step": int, **({"group": str} if args.get("async") else {}), **({"mb": int} if "stage" in args else {})}
    given = {k: float for k in ("waited_us", "wait_after_us") if k in args}
    if problem := _field_problem(args, {**need, **given}, "args."):
        return problem
    ranks = args.get("ranks", [])
    if not isinstance(ranks, list) or not all(_fits(q, int) for q in ranks):
        return f"args.ranks={ranks!r}, not a list of integers"
    return None


def read_chrome_trace(path: Path, layout: str | None = None) -> list[dict]:
    """The spans of a trace.json written above, refused by name when one lacks what the readers need (or, given the
    `layout` the run's config.yaml describes, when a launch of another layout wrote it)."""
    try:
        data = json.loads(path.read_text())
        events = data["traceEvents"]
        spans = [(i, e) for i, e in enumerate(events) if e["ph"] == "X"]
        written = data.get("otherData", {}).get("layout")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a trace sixfold wrote ({e}); train again with log.trace=true") from None
    check_layout(path, written, layout)
    for i, e in spans:
        if problem := _span_problem(e):
            raise ValueError(f"{path} is not a trace sixfold wrote (traceEvents[{i}] has {problem}); train again "
                             f"with log.trace=true")
    return [e for _, e in spans]
