"""Checkpoints on disk: safetensors files of tensor slices by global name, an index, checksums.

A checkpoint is a directory:
    model-RRRRR.safetensors   the parameter slices rank R wrote (fp32)
    optim-RRRRR.safetensors   its optimizer state slices, "<param>.exp_avg" and "<param>.exp_avg_sq"
    meta.json                 format, step, resolved config, loader state, the index (for each tensor: its
                              shape and the slices that hold it, see slices.py) and the size and sha256 of
                              every file
    meta.sha256               the sha256 of meta.json
Each slice is written by one rank (one replica of it); a checkpoint written in one layout loads in any
other. It is staged in a hidden directory and renamed when complete, so a crash mid-save leaves the last good
checkpoint; nothing is ever unpickled. A run directory keeps checkpoints under checkpoints/step_NNNNNNN with
a `latest` pointer file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import META, CheckpointConfig, Config, checkpoint_over, run_directory

FORMAT = "sixfold-checkpoint-2"
META_SHA256 = "meta.sha256"  # meta.json's own checksum (checkpoints written before it have none)
KINDS = ("model", "optim")
NOT_OURS = "the checkpoint is incomplete or was not written by sixfold"


class CheckpointError(RuntimeError):
    """A missing, corrupt or mismatched checkpoint; the message names the file."""


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_small(path: Path) -> bytes:
    """A small file of a checkpoint or run (`latest`, meta.sha256); one that cannot be read as a CheckpointError."""
    try:
        return path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror or e}); make it readable to every rank") from None


def latest_name(latest: Path) -> str:
    """The checkpoint a run's `latest` file names, as written (a garbled one as best decoded, for messages)."""
    return read_small(latest).decode(errors="replace").strip()


def resume_source(settings: CheckpointConfig, run_dir: str) -> str:
    """The checkpoint or run directory a run starts from ("" if none): checkpoint.resume, where "auto" is the run
    directory when it has a checkpoint; else checkpoint.init."""
    if settings.resume == "auto":
        return run_dir if has_checkpoint(run_dir) else settings.init
    return settings.resume or settings.init


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory (or its meta.json), or the latest checkpoint of a run directory or of a directory of
    checkpoints (its `checkpoints`, one a new run moved aside, a copy; or its `latest`): the one `latest` names, or
    without that pointer the newest complete one."""
    path = Path(path)
    if path.name in (META, "latest") and path.is_file():  # a file of the checkpoint, or of the run, given
        path = path.parent
    if (path / META).is_file():
        return path
    holder = path if (path / "latest").is_file() or steps_in(path) else path / "checkpoints"
    latest = holder / "latest"
    if latest.is_file():
        name = latest_name(latest)  # (a garbled one is named below)
        found = holder / name
        if not name.startswith("step_") or Path(name).name != name:
            raise CheckpointError(f"{latest} names {name!r}, not a checkpoint of this run; point it at one of "
                                  f"{holder}'s step_* directories, or remove it")
        if (found / META).is_file():
            return found
        for old in holder.glob(f".{found.name}.old-*"):  # a save replacing it stopped in between: read it there
            if (old / META).is_file():                  # (the next save puts it back)
                return old
        done = complete_in(holder)
        hint = f"; the newest complete one is {done[-1]}: give that path instead (to train on from it: " \
               f"checkpoint.resume={done[-1]})" if done else \
            f"; {holder} holds no complete checkpoint to read instead: to train, start anew (without " \
            f"checkpoint.resume) or give another log.run_dir"
        raise CheckpointError(f"{latest} points to {found}, which holds no {META}{hint}")
    done = complete_in(holder)
    if done:
        warnings.warn(f"{latest} is missing: reading the newest complete checkpoint, {done[-1]}")
        return done[-1]
    if not path.exists():
        keyword = " (checkpoint.resume=auto, in lower case, goes on from this run directory's newest)" if \
            str(path).lower() in ("auto", "latest") else ""
        raise CheckpointError(f"checkpoint path {path} does not exist{keyword}")
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]
    if (path / "config.json").is_file() and weights:
        raise CheckpointError(f"{path} is a Hugging Face model directory, not a checkpoint: turn it into one with "
                              f"`sixfold import-hf {path} OUT` and give OUT")
    if run_directory(path):
        raise CheckpointError(f"{path} is a run directory with no checkpoint yet: a run writes one every "
                              f"checkpoint.every steps and at its end (unless checkpoint.save_final=false)")
    if step_of(path) is not None:  # a run's checkpoint that lost (or never got) its meta.json
        raise CheckpointError(f"{path} is not a complete checkpoint: it has no {META} (a save that did not finish, "
                              f"or one that checkpoint.keep was removing){_elsewhere(path)}")
    raise CheckpointError(f"{path} is neither a checkpoint (no {META}) nor a run directory with checkpoints")


def step_of(path: Path) -> int | None:
    """The step of a step_N checkpoint directory (by number: names stop sorting in order past 7 digits)."""
    digits = path.name[len("step_"):]
    return int(digits) if path.name.startswith("step_") and digits.isdigit() else None


def steps_in(root: Path) -> list[Path]:
    """The step_N directories under `root`, oldest first."""
    return sorted((p for p in root.glob("step_*") if step_of(p) is not None), key=step_of)


def complete_in(root: Path) -> list[Path]:
    """The step_N directories under `root` that hold their meta.json, oldest first."""
    return [p for p in steps_in(root) if (p / META).is_file()]


def complete_steps(run_dir: str | Path) -> list[Path]:
    """A run directory's checkpoints that hold their meta.json, oldest first."""
    return complete_in(Path(run_dir) / "checkpoints")


def outside_checkpoints(out: str | Path) -> None:
    """Refuse an output path inside a checkpoint or a run's checkpoints/ folder, whose contents later saves replace
    and checkpoint.keep removes."""
    if parent := checkpoint_over(out):
        raise CheckpointError(f"{out} is inside {parent}, whose contents sixfold's checkpoint saves replace and "
                              f"checkpoint.keep removes; write it outside the run's checkpoints/ folder")


def has_checkpoint(run_dir: str | Path) -> bool:
    return (Path(run_dir) / "checkpoints" / "latest").is_file() or bool(complete_steps(run_dir))


def unused_path(parent: Path, stem: str) -> Path:
    """parent/STEM-DATE-TIME[-n]: a name nothing has yet."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = parent / f"{stem}-{stamp}", 1
    while path.exists():
        n += 1
        path = parent / f"{stem}-{stamp}-{n}"
    return path


def set_aside(run_dir: str | Path, after: int | None = None, first=None) -> Path | None:
    """Move an earlier run's checkpoints out of the way of a run in its directory: all of them (one that starts
    over), or those of steps after `after`, complete or not (one that resumes from an earlier step, whose own would
    replace them), to checkpoints-before-DATE-TIME beside them (returned); None if there were none. With `after`,
    first(aside) is called before any is moved (what goes with them: should it fail, they are still in place)."""
    root = Path(run_dir) / "checkpoints"
    for old in root.glob(".step_*.old-*"):  # a save replacing it stopped in between: it moves too (or is kept)
        restore_replaced(old)
    moved = list(root.glob("step_*")) if after is None else [p for p in steps_in(root) if step_of(p) > after]
    if not moved:
        return None
    aside = unused_path(root.parent, "checkpoints-before")
    if after is None:
        root.rename(aside)
        return aside
    aside.mkdir()
    if first is not None:
        try:
            first(aside)
        except BaseException:
            shutil.rmtree(aside, ignore_errors=True)
            raise
    for path in sorted(moved):
        path.rename(aside / path.name)
    latest = step_of(Path(latest_name(root / "latest"))) if (root / "latest").is_file() else None
    if latest is not None and latest > after:
        (root / "latest").replace(aside / "latest")
    return aside


def _elsewhere(path: Path) -> str:
    """What to use instead of the damaged checkpoint `path`: its run's newest other complete checkpoint, or, with
    none, a copy or a new start."""
    others = [p for p in complete_in(path.parent) if p != path]
    if not others:
        return "; no other complete checkpoint is beside it: restore it from a copy, or train anew without " \
            "checkpoint.resume"
    return f"; the newest other complete checkpoint of this run is {others[-1]}: give that path instead (to train " \
        f"on from it: checkpoint.resume={others[-1]})"


def read_meta(path: str | Path) -> dict:
    path = find_checkpoint(path)
    try:
        text = (path / META).read_bytes()
        meta = json.loads(text)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / META} is unreadable: {e}{_elsewhere(path)}") from None
    digest = path / META_SHA256
    if not digest.is_file():
        warnings.warn(f"{path / META} is read unchecked: {path} has no {META_SHA256}, which sixfold writes beside it "
                      f"(a checkpoint from before it did, or one whose {META_SHA256} was removed)")
    elif read_small(digest).strip() != hashlib.sha256(text).hexdigest().encode():  # (garbled bytes: corrupt too)
        raise CheckpointError(f"{path / META} is corrupt: its sha256 does not match {META_SHA256}{_elsewhere(path)}")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path / META} has format {found!r}, expected {FORMAT!r}")
    require(meta, {"files": dict, "index": dict}, path / META)
    require(meta, {"config": dict, "data": dict}, path / META, optional=True)
    require(meta.get("config", {}), {f.name: dict for f in dataclasses.fields(Config)}, path / META, "config.",
            optional=True)
    for name, entry in meta["files"].items():
        require(entry if isinstance(entry, dict) else {}, {"bytes": int, "sha256": str}, path / META,
                f"files.{name}.")
    _check_index(meta["index"], path / META)
    return meta


def _check_index(index: dict, where: Path) -> None:
    """Refuse an index that is not as sixfold writes it: per kind, per tensor its shape (a list of counts) and its
    slices (each a file, a key, a cut of 4 counts and a range of elements)."""
    require(index, {kind: dict for kind in KINDS}, where, "index.", optional=True)
    for kind in KINDS:
        for name, entry in index.get(kind, {}).items():
            at = f"index.{kind}.{name}"
            entry = entry if isinstance(entry, dict) else {}
            require(entry, {"slices": list}, where, f"{at}.")
            if not _counts(entry.get("shape")):
                raise CheckpointError(f"{where} has no valid '{at}.shape' (a list of counts); {NOT_OURS}")
            for i, piece in enumerate(entry["slices"]):
                piece = piece if isinstance(piece, dict) else {}
                require(piece, {"file": str, "key": str, "start": int, "stop": int}, where, f"{at}.slices.{i}.")
                if not _counts(piece.get("cut"), 4) or not _cuts(piece["cut"], entry["shape"]) or \
                        piece["stop"] < piece["start"]:
                    raise CheckpointError(f"{where} has no valid '{at}.slices.{i}' (a cut of 4 counts that cuts the "
                                          f"shape, and start at most stop); {NOT_OURS}")


def _cuts(cut: list[int], shape: list[int]) -> bool:
    """Whether (dim, parts, index, padded) is a cut of `shape`: piece `index` of `parts` along a dimension it has,
    padded (if at all) to a multiple of parts no shorter than that dimension."""
    dim, parts, index, padded = cut
    if parts == 1:
        return index == 0
    return 0 < parts and index < parts and dim < len(shape) and (
        padded == 0 or (padded >= shape[dim] and padded % parts == 0))


def _counts(value, length: int | None = None) -> bool:
    """Whether `value` is a list of counts (integers, 0 or more), `length` of them if given."""
    return isinstance(value, list) and length in (None, len(value)) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def require(meta: dict, fields: dict[str, type], where: Path, prefix: str = "", optional: bool = False) -> None:
    """Refuse a meta.json that lacks a field (unless `optional`), or holds one of another type or a negative
    count; `prefix`: where the fields lie in it."""
    for key, kind in fields.items():
        value = meta.get(key)
        if optional and key not in meta:
            continue
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            what = "a count, 0 or more" if kind is int else f"a {kind.__name__}"
            raise CheckpointError(f"{where} has no valid {prefix + key!r} ({what}); {NOT_OURS}")


class Checkpoint:
    """An opened checkpoint: meta.json, and its files, each checked against its size and sha256 when first
    read (a rank reads only the files that hold slices it needs)."""

    def __init__(self, path: str | Path):
        self.path = find_checkpoint(path)
        self.meta = read_meta(self.path)
        self._open = {}

    def index(self, kind: str) -> dict:
        return self.meta.get("index", {}).get(kind, {})

    def file(self, fname: str) -> Path:
        entry, file = self.meta["files"].get(fname), self.path / fname
        if entry is None:
            raise CheckpointError(f"{self.path} has no {fname} (its files: {', '.join(self.meta['files'])})")
        if not file.is_file():
            raise CheckpointError(f"{file} is missing{_elsewhere(self.path)}")
        try:
            same = file.stat().st_size == entry["bytes"] and file_sha256(file) == entry["sha256"]
        except OSError as e:  # a file this user may not read (another's, or one written 0600)
            raise CheckpointError(f"{file} cannot be read ({e.strerror or e}); make it readable to every rank"
                                  f"{_elsewhere(self.path)}") from None
        if not same:
            raise CheckpointError(f"{file} is corrupt: its size or checksum does not match {META}"
                                  f"{_elsewhere(self.path)}")
        return file

    def tensor(self, fname: str, key: str) -> torch.Tensor:
        if fname not in self._open:
            file = self.file(fname)
            try:
                self._open[fname] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None
        try:
            return self._open[fname].get_tensor(key)
        except (SafetensorError, KeyError) as e:
            raise CheckpointError(f"{self.path / fname} holds no tensor {key}, which the index of {META} "
                                  f"names ({e})") from None

    def blob(self, fname: str) -> bytes:
        file = self.file(fname)
        try:
            return file.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{file} cannot be read ({e.strerror or e}){_elsewhere(self.path)}") from None


def opened(source: str | Path | Checkpoint) -> Checkpoint:
    """source opened; one opened already is kept, so that every read comes from the same checkpoint even where a
    run's `latest` moves on meanwhile."""
    return source if isinstance(source, Checkpoint) else Checkpoint(source)


def check_shapes(expected: dict[str, torch.Size], found: dict[str, torch.Size], where: str, hint: str = "",
                 named=lambda name: name) -> None:
    """Refuse a checkpoint whose tensors do not match the model, naming the difference (each tensor as `named`
    gives it: as the files name it)."""
    hint = hint or "check model.* settings against the checkpoint's config"
    missing = sorted(map(named, set(expected) - set(found)))
    extra = sorted(map(named, set(found) - set(expected)))
    if missing or extra:
        raise CheckpointError(f"{where} does not match the model: missing {missing[:4]}, unexpected {extra[:4]}; "
                              f"{hint}")
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            raise CheckpointError(f"{where}: {named(name)} has shape {tuple(found[name])}, the model expects "
                                  f"{tuple(shape)}; {hint}")


# writing ----------------------------------------------------------------------------------------
def staging_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp"


def start_staging(path: Path) -> Path:
    """An empty hidden directory beside `path` to write into (a failed save's leftover is removed). An existing
    `path` is replaced once the new checkpoint is complete, so it must be a checkpoint or an empty directory."""
    if path.is_file() or (path.is_dir() and not (path / META).is_file() and any(path.iterdir())):
        raise CheckpointError(f"{path} exists and is not a sixfold checkpoint, which writing one there would "
                              f"replace; choose another output path, or move it away")
    tmp = staging_dir(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(f"cannot write a checkpoint under {path.parent}: {e}; make it writable or choose "
                              f"another directory") from None
    return tmp


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, the file then readable as its directory is: save_file makes it 0600 whatever the
    umask, which would hide a checkpoint from the rest of a group sharing the run directory."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, path.parent.stat().st_mode & 0o666)


@contextlib.contextmanager
def writing(path: Path, root: Path | None = None):
    """A failure to write `path` (a full disk, a lost mount) as a CheckpointError naming it, and the newest complete
    checkpoint under `root` (a run's checkpoints), which stays as it was."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        done = complete_in(root) if root else []
        kept = f". The newest complete checkpoint, {done[-1]}, is intact" if done else ""
        raise CheckpointError(f"cannot write {path}: {e}; make room there, or write elsewhere (log.run_dir, or the "
                              f"output path){kept}") from None


def write_tensors(tmp: Path, fname: str, tensors: dict[str, torch.Tensor]) -> dict:
    """One safetensors file; its size and sha256 for meta.json."""
    with writing(tmp / fname, tmp.parent):
        save_tensors({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, tmp / fname)
        return {"sha256": file_sha256(tmp / fname), "bytes": (tmp / fname).stat().st_size}


def publish(path: Path, tmp: Path, meta: dict, files: dict, blobs: dict[str, bytes] | None = None) -> Path:
    """Write the other files (`blobs`, e.g. a tokenizer) and meta.json into the staging directory, then move
    it to `path` (replacing an older checkpoint of that name only once the new one is complete)."""
    files = dict(files)
    with writing(tmp, path.parent):
        for fname, data in (blobs or {}).items():
            (tmp / fname).write_bytes(data)
            files[fname] = {"sha256": file_sha256(tmp / fname), "bytes": len(data)}
        text = json.dumps({**meta, "format": FORMAT, "files": files}, indent=1).encode()
        (tmp / META).write_bytes(text)
        (tmp / META_SHA256).write_text(hashlib.sha256(text).hexdigest() + "\n")
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    with writing(path, path.parent):
        if path.exists():
            path.rename(old)
        tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def restore_replaced(old: Path) -> None:
    """A checkpoint moved aside by publish: put back if a crash left nothing in its place, else removed."""
    path = old.parent / old.name[1:].rsplit(".old-", 1)[0]
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.rename(path)


def whole_slices(fname: str, tensors: dict[str, torch.Tensor]) -> dict:
    """Index entries of tensors saved whole, each under its own name."""
    return {n: {"shape": list(t.shape), "dtype": "float32",
                "slices": [{"file": fname, "key": n, "cut": [0, 1, 0, 0], "start": 0, "stop": t.numel()}]}
            for n, t in tensors.items()}


def write_checkpoint(path: str | Path, tensors: dict[str, dict[str, torch.Tensor]], meta: dict,
                     blobs: dict[str, bytes] | None = None) -> Path:
    """Write whole tensors by kind ("model", "optim") from one process, in fp32."""
    path = Path(path)
    tmp = start_staging(path)
    files, index = {}, {}
    for kind, named in tensors.items():
        fname = f"{kind}-00000.safetensors"
        named = {n: t.detach().float() for n, t in named.items()}
        files[fname] = write_tensors(tmp, fname, named)
        index[kind] = whole_slices(fname, named)
    return publish(path, tmp, {**meta, "index": index}, files, blobs)


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def point_latest(run_dir: str | Path, path: Path) -> None:
    """Point the run directory's `latest` at checkpoint `path`, atomically."""
    root = Path(run_dir) / "checkpoints"
    tmp = root / f".latest.tmp-{os.getpid()}"
    tmp.write_text(path.name)
    tmp.replace(root / "latest")


def mark_latest(run_dir: str | Path, path: Path, keep: int) -> None:
    """Point `latest` at `path` (atomically) and keep only the newest `keep` checkpoints up to it: those of later
    steps (left by an earlier, longer run in this directory) are not this run's to remove."""
    point_latest(run_dir, path)
    steps = [p for p in complete_steps(run_dir) if step_of(p) <= step_of(path)]
    for old in steps[:-keep] if keep > 0 else []:
        if old.is_symlink():  # a checkpoint kept elsewhere: only the link is this run's
            old.unlink()
            continue
        (old / META).unlink(missing_ok=True)  # first: one a kill stops part-way is not taken for complete
        shutil.rmtree(old, ignore_errors=True)
