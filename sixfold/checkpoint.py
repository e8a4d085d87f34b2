"""Checkpoints on disk: safetensors files of tensors by global name, a meta.json, checksums.

A checkpoint is a directory:
    model.safetensors   parameters by global name (fp32)
    optim.safetensors   optimizer state, "<param>.exp_avg" and "<param>.exp_avg_sq" (training checkpoints)
    meta.json           format, step, resolved config, loader and RNG state, sha256 of every file
It is written to a temporary directory and renamed when complete; nothing is ever unpickled.
A run directory keeps them under checkpoints/step_NNNNNNN with a `latest` pointer file.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT = "sixfold-checkpoint-1"
META = "meta.json"


class CheckpointError(RuntimeError):
    """A missing, corrupt or mismatched checkpoint; the message names the file."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_checkpoint(path: str | Path, files: dict[str, dict[str, torch.Tensor]], meta: dict,
                     blobs: dict[str, bytes] | None = None) -> Path:
    """Write tensors, other files (`blobs`, e.g. a tokenizer) and meta to `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    sums = {}
    for fname, tensors in files.items():
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp / fname))
        sums[fname] = {"sha256": _sha256(tmp / fname), "bytes": (tmp / fname).stat().st_size}
    for fname, data in (blobs or {}).items():
        (tmp / fname).write_bytes(data)
        sums[fname] = {"sha256": _sha256(tmp / fname), "bytes": len(data)}
    (tmp / META).write_text(json.dumps({**meta, "format": FORMAT, "files": sums}, indent=1))
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the latest checkpoint of a run directory."""
    path = Path(path)
    if (path / META).is_file():
        return path
    latest = path / "checkpoints" / "latest"
    if latest.is_file():
        found = path / "checkpoints" / latest.read_text().strip()
        if (found / META).is_file():
            return found
        raise CheckpointError(f"{latest} points to {found}, which holds no {META}")
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    raise CheckpointError(f"{path} is neither a checkpoint (no {META}) nor a run directory with checkpoints/latest")


def read_meta(path: str | Path) -> dict:
    path = find_checkpoint(path)
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / META} is unreadable: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path / META} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _verified(path: str | Path, fname: str, verify: bool) -> Path:
    """The path of one file of a checkpoint, after checking its size and sha256 against meta.json."""
    path = find_checkpoint(path)
    meta = read_meta(path)
    entry = meta["files"].get(fname)
    file = path / fname
    if entry is None:
        raise CheckpointError(f"{path} has no {fname} (its files: {', '.join(meta['files'])})")
    if not file.is_file():
        raise CheckpointError(f"{file} is missing")
    if verify and (file.stat().st_size != entry["bytes"] or _sha256(file) != entry["sha256"]):
        raise CheckpointError(f"{file} is corrupt: its checksum does not match {META}")
    return file


def read_tensors(path: str | Path, fname: str, verify: bool = True) -> dict[str, torch.Tensor]:
    file = _verified(path, fname, verify)
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None


def read_blob(path: str | Path, fname: str) -> bytes:
    return _verified(path, fname, True).read_bytes()


def check_shapes(expected: dict[str, torch.Size], found: dict[str, torch.Tensor], where: str) -> None:
    """Refuse a checkpoint whose tensors do not match the model, naming the difference."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{where} does not match the model: missing {missing[:4]}, unexpected {extra[:4]}; "
                              f"check model.* settings against the checkpoint's config")
    for name, shape in expected.items():
        if tuple(found[name].shape) != tuple(shape):
            raise CheckpointError(f"{where}: {name} has shape {tuple(found[name].shape)}, the model expects "
                                  f"{tuple(shape)}; check model.* settings against the checkpoint's config")


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def mark_latest(run_dir: str | Path, path: Path, keep: int) -> None:
    """Point `latest` at `path` (atomically) and keep only the newest `keep` checkpoints."""
    root = Path(run_dir) / "checkpoints"
    tmp = root / f".latest.tmp-{os.getpid()}"
    tmp.write_text(path.name)
    tmp.replace(root / "latest")
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
