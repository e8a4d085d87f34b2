"""`sixfold bench --max-seq`: the longest train.seq_len that a layout fits on this machine, found by probes
(fresh jobs of PROBE_STEPS training steps, benchjob.py), beside the planner's prediction for the same layout.

A probe fits unless a rank runs out of memory, and then on CUDA with --budget-gb if every rank's
max_memory_allocated is within the budget, on CPU if every rank's resident-set growth is within --budget-gb.
The search doubles train.seq_len from --min until a probe does not fit (or --max is reached), then bisects
that bracket down to 1/SPLITS of its width or the layout's multiple of train.seq_len, whichever is larger.
Only lengths that config.validate accepts for the layout are probed; model.max_seq_len is raised with the
probe (it only sizes the RoPE tables).
"""
from __future__ import annotations

import copy
import itertools
import math
from typing import Callable

from .benchjob import NO_RESUME, launch, quiet
from .config import Config, ConfigError, check_available, load_config, validate
from .measure import machine_bytes

PROBE_STEPS = 2
SPLITS = 16
MAX = 1 << 20  # default --max
GB = 1e9


def at_length(cfg: Config, seq: int) -> Config | None:
    """A probe's config: cfg at train.seq_len=seq for PROBE_STEPS steps, or None if the layout refuses seq."""
    try:
        return _probe(cfg, seq)
    except ConfigError:
        return None


def _probe(cfg: Config, seq: int) -> Config:
    """cfg at train.seq_len=seq for PROBE_STEPS steps, validated."""
    c = copy.deepcopy(cfg)
    c.train.seq_len, c.train.steps = seq, PROBE_STEPS
    c.model.max_seq_len = max(c.model.max_seq_len, seq)
    validate(c)
    return c


def below(cfg: Config, seq: int, floor: int) -> int | None:
    """The longest length in (floor, seq] that the layout accepts."""
    return next((s for s in range(seq, floor, -1) if at_length(cfg, s)), None)


def longest(fits: Callable[[int], bool], lo: int, hi: int, cfg: Config) -> tuple[int | None, int | None]:
    """The longest accepted length in [lo, hi] that fits (lo accepted), and the probed one above it that did not
    (None: none failed up to hi); a longer sequence is taken to need more memory."""
    if not fits(lo):
        return None, lo
    good, bad = lo, None
    while bad is None:
        longer = below(cfg, min(2 * good, hi), good)
        if longer is None:
            return good, None
        good, bad = (longer, None) if fits(longer) else (good, longer)
    multiple = next(s for s in itertools.count(1) if at_length(cfg, s))
    step = max(multiple, (bad - good) // SPLITS)
    while bad - good > step:
        mid = below(cfg, (good + bad) // 2, good)
        if mid is None:
            break
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good, bad


def predicted_peak(cfg: Config, cpu: bool) -> int:
    """The planner's peak bytes of the layout's fullest rank on CPUs or GPUs (the device named only sets the time
    estimate)."""
    from .planner.devices import DEVICES
    from .planner.plan import plan
    return plan(cfg, DEVICES["h100"], cfg.parallel.world_size, cpu=cpu).peak


def answer(found: tuple[int | None, int | None], top: str) -> str:
    """A search's result in words; `top` says what bounded it when nothing failed."""
    good, bad = found
    if good is None:
        return f"none: the shortest, {bad}, does not fit (lower --min, or add cp, recomputation or ZeRO)"
    return f"{good} ({bad} does not)" if bad else f"{good}, {top}"


def max_seq(path: str, overrides: list[str], budget_gb: float | None, lo: int | None, hi: int | None) -> None:
    import torch

    from .data import load_data
    from .train import check_inputs

    cfg = load_config(path, [*overrides, *NO_RESUME])
    check_available(cfg)
    cuda = torch.cuda.is_available()
    if not cuda and budget_gb is None:
        raise ConfigError("sixfold bench --max-seq on CPU needs --budget-gb X: how many GB each rank's resident "
                          "memory may grow by (there is no device memory to run out of)")
    world, total = cfg.parallel.world_size, machine_bytes()
    if not cuda and budget_gb * world * GB > total:
        most = math.floor(total / world / GB * 10) / 10
        raise ConfigError(f"--budget-gb {budget_gb:g} for each of {world} rank(s) is more than the {total / GB:.1f} "
                          f"GB of memory here (the machine's, or its cgroup's limit if less): a probe would run out "
                          f"of it before a rank reached the budget; give --budget-gb {most:g} at most")
    lo, hi = lo or cfg.train.seq_len, hi or MAX
    if lo > hi:
        default = " (by default, train.seq_len)" if lo == cfg.train.seq_len else ""
        raise ConfigError(f"--min {lo}{default} is above --max {hi}: give a --min of at most --max")
    first = next((s for s in range(lo, hi + 1) if at_length(cfg, s)), None)
    if first is None:
        try:
            _probe(cfg, lo)
        except ConfigError as e:
            raise ConfigError(f"no train.seq_len from --min {lo} to --max {hi} suits {cfg.parallel.describe()} "
                              f"(at {lo}: {e})") from None
    data = load_data(cfg.data)
    more = "more text" + (" (or a larger data.max_bytes)" if cfg.data.max_bytes else "")
    if len(data.train) - 1 < first:
        raise ConfigError(f"the corpus's train split holds {len(data.train):,} tokens, fewer than a sequence of the "
                          f"first length to probe, {first} (--min {lo}), and one more: lower --min, or give {more}")
    check_inputs(quiet(at_length(cfg, first)), data)  # what a probe trains, refused here, not by its ranks
    top = "the --max (raise --max to look further)"
    if len(data.train) - 1 < hi:  # a probe reads one sequence of seq_len + 1 tokens at least
        hi, top = len(data.train) - 1, (f"the longest sequence the corpus's train split holds ({len(data.train):,} "
                                        f"tokens; give {more} to look further)")
    t = cfg.train
    rule = "no rank runs out of CUDA memory" if cuda else f"every rank's resident memory grows by <= {budget_gb:g} GB"
    if cuda and budget_gb is not None:
        rule += f" and every rank's max_memory_allocated is <= {budget_gb:g} GB"
    print(f"{cfg.parallel.describe()}, {cfg.model.num_params():,} parameters, global batch {t.global_batch} in "
          f"{t.micro_batches} micro-batch(es), {t.precision}, recompute {cfg.model.recompute}: train.seq_len from "
          f"{first} up to {hi}; a probe of {PROBE_STEPS} steps fits if {rule}", flush=True)
    device_bytes = []

    def probe(seq: int) -> bool:
        c = at_length(cfg, seq)
        job = launch(c)
        device_bytes.append(job.ranks[0]["device_bytes"])
        peaks = [r["peak_bytes"] for r in job.ranks if not r["oom"]]
        fits = not job.oom and (budget_gb is None or max(peaks) <= budget_gb * GB)
        seen = f"peak GB per rank {', '.join(f'{p / GB:.3f}' for p in peaks)}"
        if job.oom:  # outside a step: at any length, as the model and its optimizer state are made
            seen = "out of memory" + ("" if all(r["in_step"] for r in job.ranks if r["oom"]) else " outside a step")
        planned = predicted_peak(c, not cuda)
        print(f"  seq {seq:>7}: {'fits' if fits else 'does not fit'} ({seen}); planner: {planned / GB:.3f} GB",
              flush=True)
        return fits

    measured = longest(probe, first, hi, cfg)
    if budget_gb is None:
        from .planner.plan import RESERVE
        budget, within = RESERVE * device_bytes[0], f"{RESERVE:.0%} of the GPU's {device_bytes[0] / GB:.1f} GB"
    else:
        budget, within = budget_gb * GB, f"--budget-gb {budget_gb:g}"
    planned = longest(lambda s: predicted_peak(at_length(cfg, s), not cuda) <= budget, first, hi, cfg)
    print(f"longest train.seq_len that fits, measured in {len(device_bytes)} probes: {answer(measured, top)}\n"
          f"longest train.seq_len whose planned peak fits {within}: {answer(planned, top)}")
