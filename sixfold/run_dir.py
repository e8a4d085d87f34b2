"""A run's directory: one run at a time holds it (its lock), every rank's machine sees it, every rank trains the
same config and resumes the same checkpoint, and what an earlier run left there is set aside or continued."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import warnings
from pathlib import Path

from . import checkpoint as ckpt
from .config import RUN_CONFIG_HEAD, Config, ConfigError, SUMMARIES, differing, make_run_dir
from .errors import TrainingError, on_every_rank
from .files import write_text
from .logs import start_metrics
from .mesh import ParallelContext
from .run_lock import RunLock


def resume_path(cfg: Config) -> str:
    """The checkpoint or run directory the run starts from ("" if none; see checkpoint.resume_source)."""
    return ckpt.resume_source(cfg.checkpoint, cfg.log.run_dir)


def resumes_here(cfg: Config) -> bool:
    """Whether the run continues from its own directory's checkpoints (the directory itself, its checkpoints/, or
    one in there; not one set aside in checkpoints-before-*)."""
    if not (resume := resume_path(cfg)):
        return False
    path, run_dir = Path(resume).resolve(), Path(cfg.log.run_dir)
    checkpoints = (run_dir / "checkpoints").resolve()
    return path in (run_dir.resolve(), checkpoints) or checkpoints in path.parents


def start_run_dir(cfg: Config, ctx: ParallelContext, step: int) -> None:
    """Once the trainer is built (a checkpoint to resume from loaded, at `step`): a run that does not continue its
    directory's own checkpoints moves them aside (an earlier run's, which its own would replace), with that run's
    metrics.jsonl and summaries (ledger, trace and pictures, which `sixfold trace` would draw as this run's;
    TensorBoard events, which TensorBoard would mix with this run's), to checkpoints-before-DATE-TIME, or with no
    checkpoints to run-before-DATE-TIME; one that continues them from an earlier step moves aside those of later
    steps, with their lines of metrics.jsonl, and points `latest` at its own; then config.yaml. A resume of its
    own checkpoints with no step left to train changes nothing."""
    problem = ""
    if ctx.is_main:
        try:
            _prepare_run_dir(cfg, step)
        except OSError as e:
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            problem = (f"cannot prepare {cfg.log.run_dir} for this run: {e}; "
                       f"{'make room there' if full else 'make it writable'} (or set log.run_dir "
                       f"elsewhere), then run the same command again")
    if problem := ctx.first_problem(problem):
        raise on_every_rank(TrainingError(problem))


def _prepare_run_dir(cfg: Config, step: int) -> None:
    """start_run_dir's moves and writes, on rank 0."""
    run_dir, here = Path(cfg.log.run_dir), resumes_here(cfg)
    if not here:
        aside, metrics = ckpt.set_aside(run_dir), run_dir / "metrics.jsonl"
        summaries = [run_dir / name for name in SUMMARIES if (run_dir / name).exists()]
        had_metrics = metrics.is_file() and metrics.stat().st_size > 0
        checkpoints, config = aside is not None, run_dir / "config.yaml"
        # a config.yaml that no run wrote, beside metrics.jsonl or checkpoints/: someone's own file, kept too
        theirs = config.is_file() and config.read_bytes()[:len(RUN_CONFIG_HEAD)] != RUN_CONFIG_HEAD.encode()
        if not checkpoints and (summaries or had_metrics or theirs):  # an earlier run with none: its files as they are
            aside = ckpt.unused_path(run_dir, "run-before")
            aside.mkdir()
            if had_metrics:
                metrics.rename(aside / metrics.name)
        if aside:  # with checkpoints, its metrics.jsonl goes by start_metrics below
            how = f"goes on from {resume}" if (resume := resume_path(cfg)) else "starts over"
            for path in summaries:
                path.rename(aside / path.name)
            if config.is_file():  # the settings of what is set aside (and for `sixfold trace ASIDE`)
                shutil.copy(config, aside / config.name)
            moved = [*(["checkpoints"] if checkpoints else []), *(["metrics.jsonl"] if had_metrics else []),
                     *(p.name for p in summaries), *(["config.yaml"] if config.is_file() else [])]
            newest = ckpt.complete_in(aside)
            kept = ("" if checkpoints else "it has no checkpoints; ") + \
                f"its {', '.join(moved)} {'are' if len(moved) > 1 else 'is'} moved to {aside}" + (
                    f"; to go on with it instead, stop this run and set checkpoint.resume={newest[-1]}"
                    if newest else "")
            warnings.warn(f"{run_dir} holds an earlier run: this one {how} ({kept}); to keep both runs apart, set "
                          f"another log.run_dir")
        start_metrics(run_dir, 0, aside)
    elif step < cfg.train.steps:
        if aside := ckpt.set_aside(run_dir, after=step, first=lambda aside: start_metrics(run_dir, step, aside)):
            warnings.warn(f"this run goes on from step {step} of {run_dir}, which holds checkpoints of later "
                          f"steps: they and their lines of metrics.jsonl are moved to {aside}")
        else:
            start_metrics(run_dir, step)
        if ckpt.step_dir(run_dir, step).is_dir():  # a crash before this run's first save resumes here again
            ckpt.point_latest(run_dir, ckpt.step_dir(run_dir, step))
    if not here or step < cfg.train.steps:  # (else the run's settings stay those it was trained with)
        write_text(run_dir / "config.yaml", RUN_CONFIG_HEAD + cfg.to_yaml())


def check_same_config(cfg: Config, ctx: ParallelContext) -> None:
    """Every rank trains rank 0's config (a machine launched with other overrides would go on silently with other
    settings, or hang at the end of the shorter run): else every rank stops, naming the settings that differ.
    data.cache_dir is each machine's own."""
    configs = ctx.all_gather_objects(cfg.to_dict())
    for rank, other in enumerate(configs):
        differ = [f"{k}={ours!r} where rank 0 has {theirs!r}" for k, ours, theirs in differing(other, configs[0])]
        if differ:
            raise on_every_rank(ConfigError(
                f"rank {rank} was launched with another config than rank 0: {'; '.join(differ[:4])}"
                f"{f' (and {len(differ) - 4} more)' if len(differ) > 4 else ''}; give every machine's launch the "
                f"same config file and overrides"))


def claim_run_dir(cfg: Config, ctx: ParallelContext, held: contextlib.ExitStack) -> None:
    """Rank 0 makes the run directory and takes its lock (held until `held` closes); its refusal stops every rank
    with the same message, none waiting in a collective for it."""
    problem = ""
    if ctx.is_main:
        try:
            held.enter_context(RunLock(make_run_dir(cfg)))
        except ConfigError as e:
            problem = str(e)
    problem = ctx.first_problem(problem)
    if problem:
        raise on_every_rank(ConfigError(problem))
    if ctx.world_size > 1 and (cfg.checkpoint.every or cfg.checkpoint.save_final):
        _check_shared(Path(cfg.log.run_dir), ctx)


def same_resume(resume: str, cfg: Config, ctx: ParallelContext) -> None:
    """Every rank resumes, or none does: a machine whose own disk holds no checkpoint where another's does (or the
    other way round) is refused now, naming both."""
    found = ctx.all_gather_objects((bool(resume), socket.gethostname()))
    if (other := next((r for r, (has, _) in enumerate(found) if has != found[0][0]), None)) is not None:
        has, lacks = (0, other) if found[0][0] else (other, 0)
        raise on_every_rank(ckpt.CheckpointError(
            f"rank {has} on {found[has][1]} finds a checkpoint to resume from (checkpoint.resume="
            f"{cfg.checkpoint.resume}, log.run_dir={cfg.log.run_dir}) and rank {lacks} on {found[lacks][1]} none: "
            f"every rank resumes from the same checkpoint; give checkpoint.resume a path that all machines share, or "
            f"the same copy on each"))


def _check_shared(run_dir: Path, ctx: ParallelContext) -> None:
    """Every rank writes checkpoint files into the run directory: each reads a file rank 0 writes there, so that
    ranks on machines that do not share it are refused now, not at the first save with their training lost."""
    host, name, problem = socket.gethostname(), f".shared-{os.urandom(8).hex()}", ""
    if ctx.is_main:
        try:
            (run_dir / name).write_text(host)
        except OSError as e:
            problem = f"cannot write {run_dir / name} ({e.strerror or e}); set log.run_dir to a writable directory"
    try:
        name, first, where, problem = ctx.all_gather_objects((name, host, str(run_dir.resolve()), problem))[0]
        if not problem:
            problem = ctx.first_problem("" if _holds(run_dir / name, first) else (
                f"rank {ctx.rank} on {host} does not see {run_dir.resolve() / name}, which rank 0 on {first} wrote "
                f"into {where}: the ranks of several machines need one log.run_dir that all of them share (a network "
                f"file system); set it to one"))
    finally:
        if ctx.is_main:
            (run_dir / name).unlink(missing_ok=True)
    if problem:
        raise on_every_rank(ConfigError(problem))


def _holds(path: Path, text: str) -> bool:
    try:
        return path.read_text() == text
    except OSError:
        return False
