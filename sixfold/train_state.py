"""This rank's part of a training checkpoint: the slices of weights and optimizer state it writes (one
replica of each slice writes it), and the slices it reads back in whatever layout it now runs.

Saving: every rank lists its slices; the lists are exchanged once, so each rank knows which slices it writes
and rank 0 the index; each rank snapshots its slices to CPU and writes its files into the staging directory;
rank 0 gathers their checksums, writes meta.json and renames the directory into place. With
`checkpoint.async_save` the writing runs in a background thread while training goes on (there the checksums
travel as small record files, which rank 0 waits for: no collective leaves the training thread); the next
save (and the end of the run) waits for it.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoint as ckpt
from .checkpoint import Checkpoint, CheckpointError
from .comm import Comm
from .config import RUNTIME, Config, inert, shown
from .errors import on_every_rank
from .mesh import ParallelContext
from .model.llama import full_shapes
from .optim import MOMENTS, AdamW
from .parallel.sharding import Sharded
from .slices import Cut, Reader


@dataclass
class Piece:
    kind: str  # "model" or "optim"
    name: str
    shape: tuple[int, ...]
    cut: Cut
    start: int
    stop: int
    tensor: torch.Tensor

    @property
    def key(self) -> tuple:
        return self.kind, self.name, self.shape, tuple(self.cut.as_list()), self.start, self.stop


def _slices(sharded: Sharded):
    """(unit, shard range, name, shape, cut, range in the flattened piece) of each parameter's part in this
    rank's shards."""
    for unit in sharded.units:
        for name, a, b, start in unit.segments():
            split = sharded.splits[name]
            shape = tuple(split.full_shape(unit.params[unit.names.index(name)].shape))
            yield unit, a, b, name, shape, Cut.of(split), start, start + b - a


def pieces(sharded: Sharded, optim: AdamW) -> list[Piece]:
    out = []
    for unit, a, b, name, shape, cut, start, stop in _slices(sharded):
        out.append(Piece("model", name, shape, cut, start, stop, unit.master[a:b]))
        moments = optim.moments[unit.index]
        out += [Piece("optim", f"{name}.{k}", shape, cut, start, stop, moments[k][a:b]) for k in MOMENTS]
    return out


def slice_key(name: str, start: int, stop: int) -> str:
    return f"{name}[{start}:{stop}]"


def writers(everyone: list[list[tuple]], place: list) -> dict[tuple, int]:
    """The rank that writes each slice (by key): of the lowest rank holding it and its data-parallel replicas (the
    holders at the same `place[rank]`, its tp and pp coordinates: a rank reading its tp part or stage reads no
    other's files), the one with the fewest elements to write so far, the lowest on a tie. So replicas share the
    writing."""
    holders, load = {}, [0] * len(everyone)
    for rank, keys in enumerate(everyone):
        for key in keys:
            holders.setdefault(key, []).append(rank)
    writer, candidates = {}, {}
    for key, ranks in holders.items():
        ranks = tuple(ranks)
        if ranks not in candidates:
            candidates[ranks] = [r for r in ranks if place[r] == place[ranks[0]]]
        writer[key] = min(candidates[ranks], key=load.__getitem__)  # (the first, lowest, on a tie)
        load[writer[key]] += key[-1] - key[-2]
    return writer


def build_index(everyone: list[list[tuple]], writer: dict[tuple, int]) -> dict:
    index = {kind: {} for kind in ckpt.KINDS}
    for rank, keys in enumerate(everyone):
        for key in keys:
            if writer[key] != rank:
                continue
            kind, name, shape, cut, start, stop = key
            entry = index[kind].setdefault(name, {"shape": list(shape), "dtype": "float32", "slices": []})
            entry["slices"].append({"file": f"{kind}-{rank:05d}.safetensors", "key": slice_key(name, start, stop),
                                    "cut": list(cut), "start": start, "stop": stop})
    return index


def _bytes_in(folder: Path) -> int:
    """The bytes of the files in `folder` (those renamed or removed meanwhile left out)."""
    total = 0
    for file in folder.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += file.stat().st_size
    return total


class Saver:
    """Writes this rank's part of the run's checkpoints; in the background with checkpoint.async_save."""

    def __init__(self, ctx: ParallelContext, comm: Comm, cfg: Config):
        self.ctx, self.comm = ctx, comm
        self.run_dir = Path(cfg.log.run_dir)
        self.keep, self.background = cfg.checkpoint.keep, cfg.checkpoint.async_save
        self.timeout_s = cfg.parallel.timeout_s
        self._thread: threading.Thread | None = None
        self._error, self._path = "", self.run_dir  # a background save's error, and its checkpoint

    def save(self, step: int, mine: list[Piece], meta: dict, blobs: dict[str, bytes]) -> Path:
        """Write a checkpoint of step `step` (a collective over every rank); `meta` and `blobs` from rank 0."""
        self.wait()
        path = ckpt.step_dir(self.run_dir, step)
        problem = ""
        if self.ctx.is_main:
            for old in path.parent.glob(".step_*.tmp"):  # left by a save that did not finish
                if old != ckpt.staging_dir(path):
                    shutil.rmtree(old, ignore_errors=True)
            for old in path.parent.glob(".step_*.old-*"):  # a checkpoint a save was replacing when it stopped
                ckpt.restore_replaced(old)
            try:
                ckpt.start_staging(path)
            except CheckpointError as e:
                problem = str(e)
        everyone = self.ctx.all_gather_objects(([p.key for p in mine], problem))
        if everyone[0][1]:
            raise on_every_rank(CheckpointError(everyone[0][1]))
        dims = self.ctx.dims
        place = [(r % dims.tp, dims.coords(r)["pp"]) for r in range(len(everyone))]
        writer = writers([keys for keys, _ in everyone], place)
        snapshot = [(p, p.tensor.detach().to("cpu", copy=True)) for p in mine if writer[p.key] == self.ctx.rank]
        index = build_index([keys for keys, _ in everyone], writer) if self.ctx.is_main else None
        args = (path, snapshot, index, meta, blobs)
        if self.background:
            self._path = path
            self._thread = threading.Thread(target=self._run, args=args, daemon=True, name="checkpoint")
            self._thread.start()
        else:  # the files' records travel by collective, and every rank returns once the checkpoint is in place
            written = self._together(path, lambda: self._files(path, snapshot))

            def publish() -> None:
                if index is not None:  # rank 0
                    self._publish(path, index, meta, {k: v for part in written for k, v in part.items()}, blobs)
            self._together(path, publish)
        return path

    def _together(self, path: Path, write) -> list:
        """write() on every rank, and every rank's result; if it failed on any, every rank raises that rank's
        CheckpointError (none left waiting in a collective), the staging directory removed. Ranks done first wait
        for the others however long they write (a disk slower than parallel.timeout_s allows for the largest part),
        checking in with them."""
        def attempt() -> tuple:
            try:
                return write(), ""
            except CheckpointError as e:
                return None, f"rank {self.ctx.rank}: {e}"

        everyone = self.ctx.all_gather_objects(self.ctx.all_at_once(attempt, "the ranks writing the checkpoint"))
        said = next((problem for _, problem in everyone if problem), "")
        if said:
            if self.ctx.is_main:
                shutil.rmtree(ckpt.staging_dir(path), ignore_errors=True)
            raise on_every_rank(CheckpointError(said))
        return [result for result, _ in everyone]

    def _run(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # raised by wait(), in the training thread
            self._error = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"

    def _files(self, path: Path, snapshot: list) -> dict:
        """Write this rank's files into the staging directory; their sizes and checksums."""
        tmp, files = ckpt.staging_dir(path), {}
        for kind in ckpt.KINDS:
            tensors = {slice_key(p.name, p.start, p.stop): t for p, t in snapshot if p.kind == kind}
            if tensors:
                fname = f"{kind}-{self.ctx.rank:05d}.safetensors"
                files[fname] = ckpt.write_tensors(tmp, fname, tensors)
        return files

    def _publish(self, path: Path, index: dict, meta: dict, files: dict, blobs: dict) -> None:
        ckpt.publish(path, ckpt.staging_dir(path), {**meta, "index": index}, files, blobs)
        with ckpt.writing(path.parent / "latest", path.parent):
            ckpt.mark_latest(self.run_dir, path, self.keep)

    def _write(self, path: Path, snapshot: list, index: dict | None, meta: dict, blobs: dict) -> None:
        """In the background: this rank's files, then a record of them, or of its failure; rank 0 collects every
        record (stopping at once at a failure) and publishes the checkpoint."""
        tmp = ckpt.staging_dir(path)
        try:
            files = self._files(path, snapshot)
        except CheckpointError as e:
            (tmp / f".failed-{self.ctx.rank:05d}").write_text(f"rank {self.ctx.rank}: {e}")
            raise CheckpointError(f"rank {self.ctx.rank}: {e}") from None
        record = tmp / f".files-{self.ctx.rank:05d}.json"
        with ckpt.writing(record, path.parent):
            record.with_suffix(".part").write_text(json.dumps(files))
            record.with_suffix(".part").rename(record)
        if index is not None:
            self._publish(path, index, meta, self._collect(tmp), blobs)

    def _collect(self, tmp: Path) -> dict:
        """Rank 0: every rank's record of the files it wrote, once all are there (they are then removed). It waits
        as long as the staging directory grows, up to parallel.timeout_s at a time."""
        records = [tmp / f".files-{r:05d}.json" for r in range(self.ctx.world_size)]
        deadline, written = time.monotonic() + self.timeout_s, _bytes_in(tmp)
        while not all(r.is_file() for r in records):
            failed = sorted(tmp.glob(".failed-*"))
            if failed:
                raise CheckpointError(failed[0].read_text())
            if time.monotonic() > deadline:
                if (grown := _bytes_in(tmp)) > written:  # still writing
                    deadline, written = time.monotonic() + self.timeout_s, grown
                    continue
                late = [r.name for r in records if not r.is_file()]
                raise CheckpointError(f"checkpoint {tmp}: {len(late)} rank(s) wrote nothing for "
                                      f"parallel.timeout_s={self.timeout_s} s and did not finish "
                                      f"({', '.join(late[:4])} missing); see their logs")
            time.sleep(0.01)
        files = {}
        for r in records:
            files.update(json.loads(r.read_text()))
            r.unlink()
        return files

    def wait(self) -> None:
        """Wait for a background save to finish. If it failed on any rank, every rank raises that error (all call
        this at the same points: a save, the end of the run), the unfinished save removed."""
        if self._thread is not None:  # rank 0's ends last (it publishes), however long it takes: the others wait
            thread, self._thread = self._thread, None

            def finish() -> None:
                while thread.is_alive():  # (in steps: the heartbeat's error is raised between them)
                    thread.join(1)
            self.ctx.all_at_once(finish, "the ranks finishing the background checkpoint save")
        error, self._error = self._error, ""
        if self.background:
            error = self.ctx.first_problem(error)
        if error:
            if self.ctx.is_main:
                shutil.rmtree(ckpt.staging_dir(self._path), ignore_errors=True)
            raise on_every_rank(CheckpointError(f"the background checkpoint save failed: {error}"))


# model settings a run may change when it resumes
FREE = ("max_seq_len", "init_std", *RUNTIME)
# and those of the training objective only: a resumed run may change them (said), a run from weights alone unsaid
OBJECTIVE = ("moe_aux_weight", "moe_z_weight")


def differences(meta: dict, cfg: Config, section: str = "model") -> dict[str, tuple]:
    """The settings of a config section that differ between a checkpoint's config and `cfg`: key -> (saved,
    here)."""
    now = cfg.to_dict()[section]
    # a key that an older version did not save: its default
    saved = {**Config().to_dict()[section], **meta.get("config", {}).get(section, {})}
    return {k: (v, now.get(k)) for k, v in saved.items() if now.get(k) != v}


def function_changes(meta: dict, cfg: Config) -> dict[str, tuple]:
    """The model settings that differ from a checkpoint's and change what its weights compute: not FREE or
    OBJECTIVE ones, nor RoPE fields that the rope_scaling kind both share does not use."""
    diffs = differences(meta, cfg)
    same = FREE + OBJECTIVE + _unused(diffs, cfg)
    return {k: v for k, v in diffs.items() if k not in same}


def _unused(diffs: dict, cfg: Config) -> tuple[str, ...]:
    """The RoPE fields that neither the checkpoint nor `cfg` uses: both have one rope_scaling kind."""
    return () if "rope_scaling" in diffs else inert(cfg.model)


@torch.no_grad()
def load(checkpoint: Checkpoint, sharded: Sharded, optim: AdamW, cfg: Config) -> bool:
    """Read this rank's slices of the weights (and of the optimizer state, if the checkpoint has it: returns
    whether it had) from a checkpoint written in any layout into the fp32 masters (publish_all() then makes them
    the compute weights). A training checkpoint (with optimizer state)
    resumes only the same model: settings other than FREE and OBJECTIVE must match."""
    diffs = differences(checkpoint.meta, cfg)
    free = set(FREE + OBJECTIVE + _unused(diffs, cfg))  # settings a resumed run may change: not named to match
    named = ", ".join(f"model.{k}={shown(a)} (here {shown(b)})" for k, (a, b) in diffs.items() if k not in free)
    hint = f"the checkpoint was written with {named}; set those to match to resume from it, or train this model " \
        f"from the start (without checkpoint.resume, or in another log.run_dir)" if named else \
        "check model.* settings against the checkpoint's config"
    expected = full_shapes(cfg.model)
    weights = Reader(checkpoint, "model")
    ckpt.check_shapes(expected, weights.shapes(), f"{checkpoint.path} (model)", hint)
    state = Reader(checkpoint, "optim") if checkpoint.index("optim") else None
    if state is not None:
        ckpt.check_shapes({f"{n}.{k}": s for n, s in expected.items() for k in MOMENTS}, state.shapes(),
                          f"{checkpoint.path} (optim)", hint)
    if state is not None and set(diffs) - free:
        raise CheckpointError(f"{checkpoint.path} is a training checkpoint of another model: {hint}")
    sharded.settle()  # no gather reads the masters while they are written
    flats = [torch.zeros_like(u.master) for u in sharded.units]
    for unit, a, b, name, _, cut, start, stop in _slices(sharded):
        flats[unit.index][a:b] = weights.read(name, cut, start, stop)
        if state is not None:
            for k in MOMENTS:
                optim.moments[unit.index][k][a:b] = state.read(f"{name}.{k}", cut, start, stop)
    for unit, flat in zip(sharded.units, flats):
        unit.master.copy_(flat)
    return state is not None
