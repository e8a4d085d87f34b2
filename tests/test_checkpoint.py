"""Checkpoint files: slices read back in any cut, one replica writing each slice, the staging directory, and
the bad-input suite (each bad checkpoint gives a clear error and leaves every checkpoint on disk as it was).
Resuming and resharding whole runs are in test_train.py."""
import errno
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sixfold import cli, config
from sixfold.checkpoint import (Checkpoint, CheckpointError, complete_steps, find_checkpoint, mark_latest, publish,
                                read_meta, set_aside, start_staging, write_tensors, writing)
from sixfold.config import RUN_CONFIG_HEAD, ConfigError, load_config
from sixfold.data import BPETokenizer, DataError, load_data
from sixfold.logs import read_metrics
from sixfold.mesh import ParallelContext
from sixfold.parallel.tensor import Split
from sixfold.run_lock import RunLock
from sixfold.slices import Cut, Reader
from sixfold.train import Trainer, check_inputs, data_settings, train
from sixfold.train_state import build_index, slice_key, writers
from helpers import TINY, sixfold


def _write(path: Path, name: str, t: torch.Tensor, ranks: list[tuple[Cut, int, int]]) -> Path:
    """A checkpoint of one tensor as rank r of `ranks` would write slice r."""
    tmp = start_staging(path)
    pieces = {(c.parts, c.index): Split(0, c.parts, c.index, t.shape[0], c.padded).local(t).flatten()
              for c, _, _ in ranks}
    everyone = [[("model", name, tuple(t.shape), tuple(c.as_list()), a, b)] for c, a, b in ranks]
    files = {}
    for r, (c, a, b) in enumerate(ranks):
        files[f"model-{r:05d}.safetensors"] = write_tensors(
            tmp, f"model-{r:05d}.safetensors", {slice_key(name, a, b): pieces[c.parts, c.index][a:b].clone()})
    index = build_index(everyone, {k[0]: r for r, k in enumerate(everyone)})
    return publish(path, tmp, {"index": index}, files)


def test_replicas_share_the_writing_and_a_tp_part_is_written_by_its_own_ranks():
    """4 ranks, tp 2 x 2 replicas (rank = 2 * replica + tp): a norm all hold is written by a tp-0 rank; each tp
    part's slices alternate between its two replicas."""
    norm = ("model", "norm", (8,), (0, 1, 0, 8), 0, 8)
    parts = [("model", f"w{i}", (8, 8), (0, 2, tp, 8), 0, 32) for i in range(4) for tp in (0, 1)]
    everyone = [[norm, *(p for p in parts if p[3][2] == rank % 2)] for rank in range(4)]
    writer = writers(everyone, [rank % 2 for rank in range(4)])
    assert writer[norm] == 0
    assert [writer[p] for p in parts] == [2, 1, 0, 3, 2, 1, 0, 3]  # rank 0 had the norm first


def test_slices_saved_in_one_cut_read_back_in_any_other(tmp_path):
    t = torch.randn(10, 6)  # 10 rows in 4 parts: padded to 12, pieces of 3 rows = 18 elements in 2 shards
    ranks = [(Cut(0, 4, i, 12), a, a + 9) for i in range(4) for a in (0, 9)]
    path = _write(tmp_path / "ckpt", "w", t, ranks)
    weights = Reader(Checkpoint(path), "model")
    assert torch.equal(weights.full("w"), t)
    for parts, index in [(2, 0), (2, 1), (5, 3), (4, 3)]:
        split = Split(0, parts, index, 10, -(-10 // parts) * parts)
        piece = split.local(t).flatten()
        assert torch.equal(weights.read("w", Cut.of(split), 2, len(piece)), piece[2:])
    for r in (0, 1, 2, 3, 6, 7):  # the same cut reads only its own slices' files
        (path / f"model-{r:05d}.safetensors").unlink()
    again = Reader(Checkpoint(path), "model")
    piece = Split(0, 4, 2, 10, 12).local(t).flatten()
    assert torch.equal(again.read("w", Cut(0, 4, 2, 12), 4, 18), piece[4:])
    with pytest.raises(CheckpointError, match="model-00000.safetensors is missing"):
        again.full("w")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A training checkpoint written by 4 ranks: 2 replicas x tp 2."""
    run = tmp_path_factory.mktemp("saved")
    proc = sixfold("train", TINY, f"log.run_dir={run}", "train.steps=2", "parallel.dp_replicate=2", "parallel.tp=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run / "checkpoints" / "step_0000002"


def test_each_slice_is_written_once_by_one_replica(saved):
    """Replicas share the writing: each of the 4 ranks writes about a quarter of the bytes, every slice once."""
    meta = json.loads((saved / "meta.json").read_text())
    cfg = load_config(TINY, [])
    n = cfg.model.num_params()
    for kind, per_param in (("model", 1), ("optim", 2)):
        covered = 0
        for name, entry in meta["index"][kind].items():
            keys = [(s["cut"][2], s["start"]) for s in entry["slices"]]
            assert len(keys) == len(set(keys)), name
            covered += sum(s["stop"] - s["start"] for s in entry["slices"])
        assert covered == per_param * n  # no padding in this model: every element once
        written = sum(f.stat().st_size for f in saved.glob(f"{kind}-*.safetensors"))
        assert per_param * 4 * n <= written < per_param * 4 * n * 1.1
    by_rank = [sum(f.stat().st_size for f in saved.glob(f"*-{rank:05d}.safetensors")) for rank in range(4)]
    assert max(by_rank) < 1.1 * min(by_rank), by_rank


def test_tensor_files_are_as_readable_as_the_rest(saved):
    """safetensors alone would write them 0600 whatever the umask."""
    mode = (saved / "meta.json").stat().st_mode
    assert {f.stat().st_mode for f in saved.glob("*.safetensors")} == {mode}


def _fingerprint(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _meta(path: Path, change) -> None:
    """meta.json changed as a faulty writer would leave it: its own checksum made to match."""
    meta = json.loads((path / "meta.json").read_text())
    change(meta)
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "meta.sha256").write_text(hashlib.sha256((path / "meta.json").read_bytes()).hexdigest())


def _flip_step(path):
    """One digit of meta.json altered on disk."""
    f = path / "meta.json"
    f.write_text(f.read_text().replace('"step": 2', '"step": 3'))


def _truncate(path):
    f = path / "model-00000.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _to_fp16(path):
    """A file rewritten in fp16, its checksum updated: the index says fp32."""
    f = path / "model-00001.safetensors"
    save_file({k: v.half() for k, v in load_file(str(f)).items()}, str(f))
    _meta(path, lambda m: m["files"].update({f.name: {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
                                                      "bytes": f.stat().st_size}}))


def _drop_slice(meta):
    meta["index"]["model"]["layers.0.attn.wq.weight"]["slices"].pop()


def _rename_key(meta):
    meta["index"]["optim"]["norm.weight.exp_avg"]["slices"][0]["key"] = "norm.weight.exp_avg[0:7]"


BAD = {
    "truncated file": (_truncate, [], "model-00000.safetensors is corrupt"),
    "missing shard": (lambda p: (p / "optim-00001.safetensors").unlink(), [], "optim-00001.safetensors is missing"),
    "index without a slice": (lambda p: _meta(p, _drop_slice), [],
                              "no saved slice holds 2048 element.* of layers.0.attn.wq.weight"),
    "index naming an absent tensor": (lambda p: _meta(p, _rename_key), [], "holds no tensor norm.weight.exp_avg"),
    "index naming an absent file": (
        lambda p: _meta(p, lambda m: m["index"]["model"]["norm.weight"]["slices"][0].update(file="model-00009.x")),
        [], "has no model-00009.x"),
    "model shapes": (lambda p: None, ["model.dim=128", "model.ffn_dim=352"],
                     r"embed.weight has shape \(320, 64\), the model expects \(320, 128\); the checkpoint was written "
                     r"with model.dim=64 \(here 128\), model.ffn_dim=176 \(here 352\)"),
    "wrong dtype": (_to_fp16, [], "is torch.float16 with .* expects float32"),
    "another model config": (lambda p: None, ["model.rope_theta=500000"],
                             "training checkpoint of another model: .*model.rope_theta=10000.0 \\(here 500000.0\\); "
                             "set those to match to resume from it, or train this model from the start \\(without "
                             "checkpoint.resume, or in another log.run_dir\\)"),
    "unreadable meta.json": (lambda p: (p / "meta.json").write_text("{"), [], "meta.json is unreadable"),
    "altered meta.json": (_flip_step, [], "meta.json is corrupt: its sha256 does not match meta.sha256"),
    "garbled meta.sha256": (lambda p: (p / "meta.sha256").write_bytes(b"\xa7\xff\x00"), [],
                            "meta.json is corrupt: its sha256 does not match meta.sha256"),
    "meta.json without a field": (lambda p: _meta(p, lambda m: m.pop("optimizer_steps")), [],
                                  "meta.json has no valid 'optimizer_steps'"),
    "meta.json of another shape": (lambda p: _meta(p, lambda m: m.update(files=[])), [],
                                   "meta.json has no valid 'files'"),
    "another format": (lambda p: _meta(p, lambda m: m.update(format="v0")), [], "has format 'v0'"),
    "meta.json without the loader's step": (lambda p: _meta(p, lambda m: m["loader"].pop("next_step")), [],
                                            "meta.json has no valid 'loader.next_step'"),
    "meta.json with a negative step": (lambda p: _meta(p, lambda m: m.update(step=-5)), [],
                                       r"meta.json has no valid 'step' \(a count, 0 or more\)"),
    "meta.json with a config of another shape": (lambda p: _meta(p, lambda m: m.update(config="x")), [],
                                                 "meta.json has no valid 'config'"),
    "meta.json with a file's size missing": (
        lambda p: _meta(p, lambda m: m["files"]["model-00000.safetensors"].pop("bytes")), [],
        "meta.json has no valid 'files.model-00000.safetensors.bytes'"),
    "meta.json with a config section of another shape": (
        lambda p: _meta(p, lambda m: m["config"].update(model=5)), [], "meta.json has no valid 'config.model'"),
    "meta.json without the loader's seed": (lambda p: _meta(p, lambda m: m["loader"].pop("seed")), [],
                                            "meta.json has no valid 'loader.seed'"),
    "index entry without its slices": (lambda p: _meta(p, lambda m: m["index"]["model"]["norm.weight"].pop("slices")),
                                       [], "meta.json has no valid 'index.model.norm.weight.slices'"),
    "index entry with a shape of another type": (
        lambda p: _meta(p, lambda m: m["index"]["model"]["norm.weight"].update(shape="64")), [],
        r"meta.json has no valid 'index.model.norm.weight.shape' \(a list of counts\)"),
    "index slice with a cut of another shape": (
        lambda p: _meta(p, lambda m: m["index"]["optim"]["norm.weight.exp_avg"]["slices"][0].update(cut=[0, 1])), [],
        "meta.json has no valid 'index.optim.norm.weight.exp_avg.slices.0' \\(a cut of 4 counts"),
    "index slice cut into no parts": (
        lambda p: _meta(p, lambda m: m["index"]["model"]["norm.weight"]["slices"][0].update(cut=[0, 0, 0, 0])), [],
        "no valid 'index.model.norm.weight.slices.0' \\(a cut of 4 counts that cuts the shape"),
    "index slice cut along a dimension its tensor lacks": (
        lambda p: _meta(p, lambda m: m["index"]["model"]["norm.weight"]["slices"][0].update(cut=[5, 2, 0, 0])), [],
        "no valid 'index.model.norm.weight.slices.0' \\(a cut of 4 counts that cuts the shape"),
    "meta.json without the optimizer's index": (lambda p: _meta(p, lambda m: m["index"].update(optim={})), [],
                                                "index holds no optimizer state"),
}


def test_a_meta_json_without_its_checksum_is_read_with_a_warning(saved, tmp_path):
    """A checkpoint from before meta.sha256 was written, or whose meta.sha256 was removed: its meta.json cannot be
    checked, which is said (an edit to it would otherwise go unseen)."""
    bare = tmp_path / "bare"
    shutil.copytree(saved, bare)
    (bare / "meta.sha256").unlink()
    with pytest.warns(UserWarning, match=f"{bare}/meta.json is read unchecked: {bare} has no meta.sha256"):
        assert read_meta(bare)["step"] == 2


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_checkpoint_is_refused_by_name_and_nothing_on_disk_changes(saved, tmp_path, case):
    spoil, overrides, message = BAD[case]
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    spoil(bad)
    before = _fingerprint(saved.parent.parent), _fingerprint(bad)
    cfg = load_config(TINY, [f"checkpoint.resume={bad}", f"log.run_dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(CheckpointError, match=message):
        Trainer(cfg, ParallelContext.single())
    assert (_fingerprint(saved.parent.parent), _fingerprint(bad)) == before


def test_a_refused_checkpoint_names_only_the_settings_to_match(saved, tmp_path):
    """model.loss_chunk and model.recompute are the run's own (RUNTIME): a resumed run may change them, so the
    refusal of another model shape does not ask to set them as the checkpoint's run had them."""
    cfg = load_config(TINY, [f"checkpoint.resume={saved}", f"log.run_dir={tmp_path / 'run'}", "model.dim=128",
                             "model.loss_chunk=8", "model.recompute=full"])
    with pytest.raises(CheckpointError, match=r"written with model.dim=64 \(here 128\); set those") as e:
        Trainer(cfg, ParallelContext.single())
    assert "loss_chunk" not in str(e.value) and "recompute" not in str(e.value)


def test_a_training_checkpoint_resumes_with_rope_fields_its_scaling_does_not_use(saved, tmp_path):
    """rope_factor means nothing with model.rope_scaling=none: the run is the checkpoint's model. An earlier version
    saved it so; a config that sets it now is refused."""
    old = tmp_path / "old"
    shutil.copytree(saved, old)
    _meta(old, lambda m: m["config"]["model"].update(rope_factor=4.0))
    cfg = load_config(TINY, [f"checkpoint.resume={old}", f"log.run_dir={tmp_path / 'run'}"])
    assert Trainer(cfg, ParallelContext.single()).step == 2
    with pytest.raises(ConfigError, match="model.rope_factor=4.0: model.rope_scaling=none leaves it unused"):
        load_config(TINY, [f"checkpoint.resume={saved}", "model.rope_factor=4"])


def test_an_unwritable_run_directory_is_refused_before_training(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")
    assert cli.main(["train", TINY, f"log.run_dir={tmp_path / 'file' / 'run'}"]) == 2
    assert "log.run_dir=" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("")  # the checkpoints directory cannot be made: refused before training
    cfg = load_config(TINY, [f"log.run_dir={run}", "train.steps=1"])
    with pytest.raises(ConfigError, match="checkpoints is not a directory, and this run writes one there"):
        train(cfg)
    (run / "checkpoints").unlink()
    (run / "metrics.jsonl").mkdir()
    with pytest.raises(ConfigError, match="metrics.jsonl is not a file"):
        train(cfg)
    (run / "metrics.jsonl").rmdir()
    (run / "timeline.png").mkdir()  # a picture drawn at the run's end
    with pytest.raises(ConfigError, match="timeline.png is not a file"):
        train(cfg)
    (run / "timeline.png").rmdir()
    (run / "checkpoints").mkdir()  # read-only (as root, whom file modes do not stop, by its probe failing)
    probe = config._probe

    def read_only(directory):
        if directory.name == "checkpoints":
            raise PermissionError(13, "Permission denied")
        probe(directory)
    monkeypatch.setattr(config, "_probe", read_only)
    for resume in ("", "auto"):  # a resumed run points `latest` there before its first step
        with pytest.raises(ConfigError, match=f"{run / 'checkpoints'} cannot be written \\(Permission denied\\), and "
                                              "this run writes its checkpoints there: make it writable, or set"):
            train(load_config(TINY, [f"log.run_dir={run}", "train.steps=1", f"checkpoint.resume={resume}"]))


def test_an_unfinished_save_is_ignored_and_cleared_and_the_last_k_are_kept(tmp_path):
    """A staging directory left by a crash is removed; a checkpoint a crash left moved aside is put back."""
    run = tmp_path / "run"
    common = [f"log.run_dir={run}", "checkpoint.every=1", "checkpoint.resume=auto"]
    train(load_config(TINY, [*common, "train.steps=2"]))
    partial = run / "checkpoints" / ".step_0000003.tmp"  # a save that crashed midway
    partial.mkdir()
    (partial / "model-00000.safetensors").write_bytes(b"half")
    replaced = run / "checkpoints" / ".step_0000002.old-99"  # a save of step 2 again, stopped between its renames
    (run / "checkpoints" / "step_0000002").rename(replaced)
    assert find_checkpoint(run) == replaced and replaced.is_dir()  # read where it lies (a read-only run, say)
    train(load_config(TINY, [*common, "train.steps=3"]))
    assert read_metrics(run)[-1]["step"] == 3 and not replaced.exists()  # resumed from step 2 moved aside, put back
    assert not partial.exists() and (run / "checkpoints" / "latest").read_text() == "step_0000003"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000002", "step_0000003"]  # keep=2
    for given in ("checkpoints", "checkpoints/latest", "checkpoints/step_0000003/meta.json"):  # its run's latest
        assert find_checkpoint(run / given) == run / "checkpoints" / "step_0000003"


def test_a_run_directory_with_no_checkpoint_yet_is_named_so(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(RUN_CONFIG_HEAD + "train:\n  steps: 3\n")
    with pytest.raises(CheckpointError, match="run is a run directory with no checkpoint yet: a run writes one every "
                                              "checkpoint.every steps and at its end"):
        find_checkpoint(run)
    (run / "config.yaml").write_text("train:\n  steps: 3\n")  # a user's config beside other files: not a run
    with pytest.raises(CheckpointError, match="is neither a checkpoint"):
        find_checkpoint(run)
    (run / "checkpoints" / "step_0000002").mkdir(parents=True)  # latest left pointing at a checkpoint removed by hand
    (run / "checkpoints" / "latest").write_text("step_0000002")
    with pytest.raises(CheckpointError, match="step_0000002, which holds no meta.json; .*checkpoints holds no complete "
                                              "checkpoint to read instead: to train, start anew \\(without "
                                              "checkpoint.resume\\) or give another log.run_dir"):
        find_checkpoint(run)
    with pytest.raises(CheckpointError, match="step_0000002 is not a complete checkpoint: it has no meta.json"):
        find_checkpoint(run / "checkpoints" / "step_0000002")
    (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe step")  # garbled: named, not a decoding error
    with pytest.raises(CheckpointError, match="latest names .*, not a checkpoint of this run; point it at one of"):
        find_checkpoint(run)


def test_a_run_that_starts_over_moves_the_earlier_runs_checkpoints_aside(tmp_path):
    """A run in a directory that holds an earlier run's checkpoints, not resuming them, writes its own beside them:
    none of the earlier ones is replaced or removed. Without `latest`, resume=auto takes the newest complete one."""
    run = tmp_path / "run"
    common = [f"log.run_dir={run}", "checkpoint.every=1", "checkpoint.keep=2"]
    train(load_config(TINY, [*common, "train.steps=3"]))
    earlier = {p.name: (p / "model-00000.safetensors").read_bytes() for p in (run / "checkpoints").glob("step_*")}
    ledger = (run / "comm_ledger.json").read_text()
    with pytest.warns(UserWarning, match="holds an earlier run: this one starts over.*its checkpoints, metrics.jsonl, "
                                         "comm_ledger.json, config.yaml are moved to .*; to go on with it instead, "
                                         "stop this run "
                                         "and set checkpoint.resume=.*checkpoints-before-.*/step_0000003"):
        train(load_config(TINY, [*common, "train.steps=2", "train.seed=7"]))
    (aside,) = run.glob("checkpoints-before-*")
    assert (aside / "comm_ledger.json").read_text() == ledger  # with its run, not replaced by this one's
    assert cli.main(["trace", str(aside)]) == 0 and (aside / "mesh.png").is_file()  # its config.yaml beside it
    assert {p.name: (p / "model-00000.safetensors").read_bytes() for p in aside.glob("step_*")} == earlier
    assert find_checkpoint(aside) == aside / "step_0000003"  # read through its latest, as generate would
    shutil.copytree(aside, tmp_path / "copy")  # a copy of a checkpoints directory, under any name
    assert find_checkpoint(tmp_path / "copy") == tmp_path / "copy" / "step_0000003"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000001", "step_0000002"]
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "step_0000005").mkdir()  # no meta.json: not a checkpoint, nor counted by keep
    with pytest.warns(UserWarning) as said:
        train(load_config(TINY, [*common, "train.steps=3", "train.seed=7", "checkpoint.resume=auto"]))
    assert sum("latest is missing: reading the newest complete checkpoint" in str(w.message) for w in said) == 1
    (later,) = set(run.glob("checkpoints-before-*")) - {aside}  # the unfinished later step, out of this run's way
    assert read_metrics(run)[-1]["step"] == 3 and [p.name for p in later.iterdir()] == ["step_0000005"]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000002", "step_0000003"]


def test_a_damaged_checkpoint_names_the_runs_newest_other_one(tmp_path):
    run = tmp_path / "run"
    train(load_config(TINY, [f"log.run_dir={run}", "train.steps=2", "checkpoint.every=1"]))
    _truncate(run / "checkpoints" / "step_0000002")
    with pytest.raises(CheckpointError, match="step_0000002/model-00000.safetensors is corrupt: .*; the newest other "
                                              "complete checkpoint of this run is .*step_0000001: give that path "
                                              "instead \\(to train on from it: checkpoint.resume=.*step_0000001\\)"):
        Trainer(load_config(TINY, [f"log.run_dir={run}", "checkpoint.resume=auto"]), ParallelContext.single())
    (run / "checkpoints" / "step_0000002" / "meta.json").write_text("{")  # its meta.json too
    with pytest.raises(CheckpointError, match="step_0000002/meta.json is unreadable: .*; the newest other complete "
                                              "checkpoint of this run is .*step_0000001"):
        Trainer(load_config(TINY, [f"log.run_dir={run}", "checkpoint.resume=auto"]), ParallelContext.single())
    shutil.rmtree(run / "checkpoints" / "step_0000001")  # with no other: a copy, or a new start
    with pytest.raises(CheckpointError, match="meta.json is unreadable: .*; no other complete checkpoint is beside "
                                              "it: restore it from a copy, or train anew without checkpoint.resume"):
        Trainer(load_config(TINY, [f"log.run_dir={run}", "checkpoint.resume=auto"]), ParallelContext.single())


def test_a_failed_write_names_the_newest_checkpoint_it_left_intact(tmp_path):
    def full(root):
        with pytest.raises(CheckpointError) as said, writing(tmp_path / ".step_0000004.tmp", root):
            raise OSError(errno.ENOSPC, "No space left on device")
        return str(said.value)

    assert full(tmp_path).endswith("No space left on device; make room there, or write elsewhere (log.run_dir, or "
                                   "the output path)")  # the first save: nothing is there to keep
    (tmp_path / "step_0000002").mkdir()
    (tmp_path / "step_0000002" / "meta.json").write_text("{}")
    assert full(tmp_path).endswith(f"the output path). The newest complete checkpoint, {tmp_path / 'step_0000002'}, "
                                   f"is intact")


def test_a_garbled_latest_does_not_stop_a_resume_from_an_earlier_step(tmp_path):
    for step in (2, 4):
        (tmp_path / "checkpoints" / f"step_000000{step}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_bytes(b"\xff\xfe garbage")
    aside = set_aside(tmp_path, after=2)
    assert [p.name for p in aside.iterdir()] == ["step_0000004"] and (tmp_path / "checkpoints" / "latest").is_file()


def test_checkpoints_are_ordered_by_step_number(tmp_path):
    for name in ("step_10000000", "step_9999999", "step_0000002", "step_notes"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        (tmp_path / "checkpoints" / name / "meta.json").write_text("{}")
    assert [p.name for p in complete_steps(tmp_path)] == ["step_0000002", "step_9999999", "step_10000000"]


def test_a_run_directory_inside_a_checkpoint_is_refused_before_training(saved, capsys):
    """checkpoint.keep would remove it with the checkpoint, and a save of that step replace it."""
    for run_dir, where in ((saved / "run", f"is inside {saved}"), (saved.parent, f"is {saved.parent}")):
        assert cli.main(["train", TINY, f"log.run_dir={run_dir}", "train.steps=1"]) == 2
        assert f"log.run_dir {run_dir} {where}, whose contents checkpoint saves replace and checkpoint.keep removes " \
            "(this run's with them): set log.run_dir outside any run's checkpoints/ folder" in capsys.readouterr().err
    assert not (saved / "run").exists()
    project = saved.parent.parent.parent / "project"  # another tool's meta.json above it: no checkpoint
    (project / "runs").mkdir(parents=True)
    (project / "meta.json").write_text('{"name": "my project"}')
    assert config.make_run_dir(load_config(TINY, [f"log.run_dir={project / 'runs' / 'a'}"])).is_dir()


def test_a_lock_file_this_user_may_not_write_still_keeps_a_second_run_out(tmp_path, monkeypatch):
    """Another user's .lock in a shared directory (root writes any, so the refusal is stood in for)."""
    import os

    (tmp_path / ".lock").write_text("their-host 1\n")
    opened = os.open

    def read_only(path, flags, *args):
        if flags & os.O_RDWR:
            raise PermissionError(13, "Permission denied", str(path))
        return opened(path, flags, *args)

    with monkeypatch.context() as patched:
        patched.setattr(os, "open", read_only)
        with RunLock(tmp_path), pytest.raises(ConfigError, match="is in use by another run"):
            RunLock(tmp_path).__enter__()


def test_checkpoint_keep_removes_a_linked_checkpoint_by_its_link(tmp_path):
    archive = tmp_path / "archive" / "step_0000001"
    root = tmp_path / "run" / "checkpoints"
    for step in (archive, root / "step_0000002", root / "step_0000003"):
        step.mkdir(parents=True)
        (step / "meta.json").write_text("{}")
    (root / "step_0000001").symlink_to(archive)
    mark_latest(tmp_path / "run", root / "step_0000003", keep=2)
    assert (archive / "meta.json").is_file() and sorted(p.name for p in root.iterdir()) == [
        "latest", "step_0000002", "step_0000003"]


def test_a_run_directory_is_one_runs_at_a_time_and_keeps_what_it_did_not_write(tmp_path, capsys):
    """A second run in a directory another run holds is refused (before its processes start, and by its rank 0);
    a config.yaml no sixfold run wrote (the config being trained from) is not replaced; an earlier run's
    metrics.jsonl and summaries without checkpoints are moved aside, not replaced (nor drawn as the next run's)."""
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run):
        assert cli.main(["train", TINY, f"log.run_dir={run}", "train.steps=1"]) == 2
        assert f"log.run_dir={run} is in use by another run" in capsys.readouterr().err
        with pytest.raises(ConfigError, match="is in use by another run .* set another log.run_dir"):
            train(load_config(TINY, [f"log.run_dir={run}", "train.steps=1"]))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text(Path(TINY).read_text())
    assert cli.main(["train", str(mine / "config.yaml"), f"log.run_dir={mine}", "train.steps=1"]) == 2
    assert "config.yaml was not written by a sixfold run" in capsys.readouterr().err
    assert (mine / "config.yaml").read_text() == Path(TINY).read_text() and not (mine / "metrics.jsonl").exists()
    assert cli.main(["train", TINY, "log.run_dir= ", "train.steps=1"]) == 2
    assert "log.run_dir is empty" in capsys.readouterr().err
    assert cli.main(["train", TINY, f"log.run_dir={mine / 'config.yaml'}", "train.steps=1"]) == 2
    assert f"log.run_dir={mine / 'config.yaml'} is a file, not a directory" in capsys.readouterr().err
    (mine / "tensorboard").write_text("")
    assert cli.main(["train", TINY, f"log.run_dir={mine}", "log.tensorboard=true", "train.steps=1"]) == 2
    assert f"{mine / 'tensorboard'} is not a directory, and this run writes one there" in capsys.readouterr().err
    common = [f"log.run_dir={run}", "train.steps=2", "checkpoint.save_final=false"]
    train(load_config(TINY, [*common, "log.trace=true", "log.tensorboard=true"]))
    assert (run / "config.yaml").read_text().startswith(RUN_CONFIG_HEAD)
    before, trace = (run / "metrics.jsonl").read_text(), (run / "trace.json").read_text()
    with pytest.warns(UserWarning, match="it has no checkpoints; its metrics.jsonl, comm_ledger.json, trace.json, "
                                         "timeline.png, mesh.png, tensorboard, config.yaml are moved to "
                                         ".*run-before-"):
        train(load_config(TINY, common))
    (moved,) = run.glob("run-before-*")  # all in one folder, where `sixfold trace` draws them again
    assert (moved / "metrics.jsonl").read_text() == before and len(read_metrics(run)) == 2
    assert (moved / "trace.json").read_text() == trace and (moved / "config.yaml").is_file()
    assert not (run / "trace.json").exists() and not (run / "timeline.png").exists()
    assert (moved / "timeline.png").is_file() and (run / "comm_ledger.json").is_file()
    assert len(list(moved.glob("tensorboard/events.*"))) == 1 and not (run / "tensorboard").exists()
    assert cli.main(["trace", str(moved)]) == 0


def test_a_run_that_starts_over_keeps_the_config_yaml_of_what_it_moves_aside(tmp_path):
    """An earlier run's metrics.jsonl goes aside with the config.yaml it was trained with (a run stopped by a NaN
    loss leaves nothing else); so does a config.yaml no run wrote beside an empty checkpoints/ (someone's own)."""
    run, mine = tmp_path / "run", tmp_path / "mine"
    common = ["train.steps=1", "checkpoint.save_final=false", "log.tensorboard=false"]
    train(load_config(TINY, [*common, f"log.run_dir={run}", "train.lr=0.5"]))
    with pytest.warns(UserWarning, match="it has no checkpoints; its metrics.jsonl, comm_ledger.json, config.yaml are "
                                         "moved to .*run-before-"):
        train(load_config(TINY, [*common, f"log.run_dir={run}"]))
    (moved,) = run.glob("run-before-*")
    assert "lr: 0.5\n" in (moved / "config.yaml").read_text() and "lr: 0.5\n" not in (run / "config.yaml").read_text()
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "config.yaml").write_text("# my notes\n")
    with pytest.warns(UserWarning, match="it has no checkpoints; its config.yaml is moved to .*run-before-"):
        train(load_config(TINY, [*common, f"log.run_dir={mine}"]))
    (kept,) = mine.glob("run-before-*")
    assert (kept / "config.yaml").read_text() == "# my notes\n"
    assert (mine / "config.yaml").read_text().startswith(RUN_CONFIG_HEAD)


def test_the_last_periodic_checkpoint_is_written_without_a_final_one(tmp_path):
    run = tmp_path / "run"
    train(load_config(TINY, [f"log.run_dir={run}", "train.steps=4", "checkpoint.every=2",
                             "checkpoint.save_final=false", "checkpoint.keep=0"]))
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000002", "step_0000004"]


def test_a_directory_that_is_not_a_checkpoint_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not a sixfold checkpoint"):
        start_staging(out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    again = _write(tmp_path / "ckpt", "w", torch.ones(4), [(Cut(0, 1, 0, 4), 0, 4)])
    assert _write(again, "w", torch.zeros(4), [(Cut(0, 1, 0, 4), 0, 4)]) == again  # a checkpoint is replaced
    assert torch.equal(Reader(Checkpoint(again), "model").full("w"), torch.zeros(4))


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.dp_shard=2", "parallel.zero=2"]])
def test_a_bad_file_that_one_rank_reads_stops_every_rank_with_its_message(saved, tmp_path, layout):
    """Under tp=2 rank 0 reads only model-00000 and rank 1 only model-00001, and so under ZeRO-2 from a checkpoint
    written so: rank 1's error reaches rank 0, so both end with it instead of rank 0 failing later in a collective
    (under ZeRO-2 the gather of the weights read, which rank 1 would not have joined: an abort on gloo)."""
    if "parallel.zero=2" in layout:
        first = sixfold("train", TINY, f"log.run_dir={tmp_path / 'first'}", "train.steps=2", *layout)
        assert first.returncode == 0, first.stderr[-3000:]
        saved = tmp_path / "first" / "checkpoints" / "step_0000002"
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    f = bad / "model-00001.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    proc = sixfold("train", TINY, f"log.run_dir={tmp_path / 'run'}", "train.steps=3", *layout,
                   f"checkpoint.resume={bad}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("sixfold error: ") == 1, proc.stderr[-3000:]  # every rank's, said once
    assert "model-00001.safetensors is corrupt: its size or checksum does not match meta.json; no other complete " \
           "checkpoint is beside it: restore it from a copy, or train anew without checkpoint.resume (rank 1)" in \
        proc.stderr, proc.stderr[-3000:]


def test_a_file_that_cannot_be_read_is_refused_naming_it(saved, monkeypatch):
    """A shard another user wrote 0600 (root reads any, so the refusal is stood in for)."""
    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("sixfold.checkpoint.file_sha256", denied)
    with pytest.raises(CheckpointError, match=r"model-00000.safetensors cannot be read \(Permission denied\); make "
                                              "it readable to every rank"):
        Checkpoint(saved).file("model-00000.safetensors")
    opened = Path.open
    for name in ("latest", "meta.sha256"):  # its small files too: named, not a traceback
        monkeypatch.setattr(Path, "open", lambda p, *a, **k: denied(p) if p.name == name else opened(p, *a, **k))
        with pytest.raises(CheckpointError, match=rf"{name} cannot be read \(Permission denied\); make it readable"):
            Checkpoint(saved.parent.parent)


def test_a_resume_with_another_batch_and_context_goes_on_in_their_order_and_says_so_once(saved, tmp_path):
    """A larger batch or a longer context from a checkpoint (batch ramp-up, context extension): the run goes on from
    its step with the batches of the new settings, warned of once."""
    proc = sixfold("train", TINY, f"log.run_dir={tmp_path / 'run'}", "train.steps=3", "parallel.tp=2",
                   "train.global_batch=4", "train.seq_len=64", f"checkpoint.resume={saved}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = "with train.seq_len=64 (the checkpoint's run: 32), train.global_batch=4 (the checkpoint's run: 8): " \
        "from step 3 the batches follow the order of these settings"
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [3]


def test_resuming_on_other_text_of_the_same_length_or_with_other_settings_warns(tmp_path):
    """The checkpoint keeps a digest of tokens spread over the training split, not only their count; train.*
    settings that differ from the checkpoint's run are named."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("def f(x):\n    return x + 1\n" * 400)
    b.write_text("def g(y):\n    return y * 2\n" * 400)
    run = tmp_path / "run"
    train(load_config(TINY, [f"log.run_dir={run}", f"data.source={a}", "train.steps=1"]))
    with pytest.warns(UserWarning) as caught:
        train(load_config(TINY, [f"log.run_dir={run}", f"data.source={b}", "train.steps=2", "train.lr=0.001",
                                 "checkpoint.resume=auto"]))
    said = [str(w.message) for w in caught]
    assert any("the training data differ from the checkpoint's (as many tokens, but other ones)" in m for m in said)
    assert any("with train.steps=2 (the checkpoint's run: 1), train.lr=0.001 (the checkpoint's run: 0.003): the "
               "learning-rate schedule and AdamW go on with the new values from step 2; the learning rate of step 2 "
               "is 0.001 (the checkpoint's run ended at step 1, at 0.0015)" in m for m in said), said


def test_a_checkpoint_to_start_from_that_is_not_there_is_named_before_the_corpus_is_read(tmp_path):
    """Not a BPE trained first and refused for its size: the model's settings could not come from the checkpoint."""
    cfg = load_config(None, [f"checkpoint.resume={tmp_path / 'nope'}", "data.tokenizer=bpe", "model.vocab_size=300"])
    with pytest.raises(CheckpointError, match=r"checkpoint path .*nope does not exist"):
        data_settings(cfg)
    with pytest.raises(CheckpointError, match=r"checkpoint path AUTO does not exist \(checkpoint.resume=auto, in "
                                              r"lower case, goes on from this run directory's newest\)"):
        data_settings(load_config(None, ["checkpoint.resume=AUTO"]))


def test_a_warmup_stable_decay_run_extended_before_its_decay_ends_as_the_longer_run(tmp_path):
    """A run of 6 steps decaying over its last 2, resumed from step 3 with train.steps=8: the same losses as a run
    of 8 steps from the start (its learning rate until step 6 does not depend on the run's length)."""
    wsd = ["train.schedule=linear", "train.decay_steps=2"]
    train(load_config(TINY, [f"log.run_dir={tmp_path / 'short'}", *wsd, "train.steps=6", "checkpoint.every=3"]))
    train(load_config(TINY, [f"log.run_dir={tmp_path / 'long'}", *wsd, "train.steps=8"]))
    with pytest.warns(UserWarning, match=r"with train.steps=8 \(the checkpoint's run: 6\)"):
        train(load_config(TINY, [f"log.run_dir={tmp_path / 'more'}", *wsd, "train.steps=8",
                                 f"checkpoint.resume={tmp_path / 'short' / 'checkpoints' / 'step_0000003'}"]))
    short, long, more = (read_metrics(tmp_path / name) for name in ("short", "long", "more"))
    assert [m["loss"] for m in short[:3]] == [m["loss"] for m in long[:3]]
    assert [m["step"] for m in more] == [4, 5, 6, 7, 8]
    assert [(m["loss"], m["lr"]) for m in more] == [(m["loss"], m["lr"]) for m in long[3:]]
    assert short[-1]["lr"] < long[5]["lr"] == long[3]["lr"]


def test_resuming_an_moe_model_with_other_micro_batches_or_loss_weights_warns(tmp_path):
    """Its load-balancing loss is taken per micro-batch: the run would go on with another objective; so does it with
    other weights of the load-balancing and z losses, which a run may change (not the model's function)."""
    run = tmp_path / "run"
    train(load_config(TINY, [f"log.run_dir={run}", "model.moe_experts=4", "train.steps=1"]))
    with pytest.warns(UserWarning, match="with train.micro_batches=2 \\(the checkpoint's run: 1\\): an MoE layer's "
                                         "load-balancing loss is taken per micro-batch, so from step 2 the run trains "
                                         "on another objective; set train.micro_batches=1"):
        train(load_config(TINY, [f"log.run_dir={run}", "model.moe_experts=4", "train.steps=2", "train.micro_batches=2",
                                 "checkpoint.resume=auto"]))
    with pytest.warns(UserWarning, match="with model.moe_aux_weight=0.1 \\(the checkpoint's run: 0.01\\), "
                                         "model.moe_z_weight=0.0 \\(the checkpoint's run: 0.001\\): the run trains "
                                         "on the new objective from step 3"):  # as the guide advises, if shares drift
        train(load_config(TINY, [f"log.run_dir={run}", "model.moe_experts=4", "train.steps=3", "train.micro_batches=2",
                                 "model.moe_aux_weight=0.1", "model.moe_z_weight=0", "checkpoint.resume=auto"]))


def test_checkpoint_init_starts_a_run_that_auto_then_goes_on_with(tmp_path):
    """A job script that stays the same when the job is requeued: checkpoint.resume=auto goes on from the run's own
    checkpoint where there is one, else from checkpoint.init (a fine-tuning's imported model)."""
    train(load_config(TINY, [f"log.run_dir={tmp_path / 'base'}", "train.steps=2"]))
    init = [f"checkpoint.init={tmp_path / 'base'}", "train.steps=4", "train.schedule=constant"]  # (as steps=3 has it)
    whole = train(load_config(TINY, [f"log.run_dir={tmp_path / 'whole'}", *init]))
    job = [f"log.run_dir={tmp_path / 'job'}", "checkpoint.resume=auto", *init]
    first = train(load_config(TINY, [*job, "train.steps=3"]))
    again = train(load_config(TINY, job))
    assert [[m["step"] for m in run] for run in (whole, first, again)] == [[3, 4], [3], [4]]
    assert [m["loss"] for m in first + again] == [m["loss"] for m in whole]
    with pytest.raises(ConfigError, match=f"checkpoint.resume={tmp_path / 'base'} names one: leave one of them out"):
        load_config(TINY, [f"checkpoint.resume={tmp_path / 'base'}", *init])


def test_resuming_with_another_document_mask_warns(tmp_path):
    """The attention changes from the next step: allowed (as a longer context is), but said."""
    run = tmp_path / "run"
    train(load_config(TINY, [f"log.run_dir={run}", "train.steps=1"]))
    with pytest.warns(UserWarning, match="with data.document_mask=true \\(the checkpoint's run: false\\): from step "
                                         "2 a token attends to its own document only; set data.document_mask=false"):
        train(load_config(TINY, [f"log.run_dir={run}", "train.steps=2", "data.document_mask=true",
                                 "checkpoint.resume=auto"]))


def test_resuming_with_another_tokenizer_is_refused(saved, tmp_path):
    """Its ids would mean other text to the model; the checkpoint names the tokenizer it was trained with. A byte-level
    run's holds no tokenizer.json (data.tokenizer=bpe would read that)."""
    assert "tokenizer.json" not in Checkpoint(saved).meta["files"]
    cfg = load_config(TINY, [f"checkpoint.resume={saved}", f"log.run_dir={tmp_path / 'run'}", "data.tokenizer=bpe",
                             "data.bpe_vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(DataError, match="trained with the tokenizer 'byte' and this run's data.* settings give 'bpe-"):
        Trainer(cfg, ParallelContext.single())


def test_a_tokenizer_larger_than_the_checkpoint_s_vocabulary_is_refused_naming_the_checkpoint(saved, tmp_path):
    """Raising model.vocab_size would not do: the checkpoint's embeddings are that many."""
    tok = tmp_path / "tokenizer.json"
    BPETokenizer.train([Path(json.__file__).read_text(), Path(shutil.__file__).read_text()], 400).save(tok)
    cfg = load_config(TINY, [f"checkpoint.resume={saved}", f"data.tokenizer={tok}", f"data.cache_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=re.escape(
            f"model.vocab_size=320 is smaller than the tokenizer's 400 tokens (data.tokenizer={tok}); train from "
            f"{saved} with the tokenizer it was trained with (data.tokenizer=bpe reads the one it holds, if it holds "
            f"one)")):
        check_inputs(cfg, load_data(data_settings(cfg)))


def test_a_bpe_run_resumes_with_its_own_tokenizer_after_the_corpus_changed(tmp_path):
    """data.tokenizer=bpe trained again on the changed corpus would be another tokenizer: the checkpoint's is read."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, word in (("a", "alpha"), ("b", "beta"), ("c", "gamma")):
        (corpus / f"{name}.txt").write_text(f"def {word}(x):\n    return x + {len(word)}\n" * 300)
    common = [f"log.run_dir={tmp_path / 'run'}", f"data.source={corpus}", "data.tokenizer=bpe",
              "data.bpe_vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}", "checkpoint.resume=auto"]
    train(load_config(TINY, [*common, "train.steps=1"]))
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_0000001" / "meta.json").read_text())
    (corpus / "b.txt").unlink()
    with pytest.warns(UserWarning, match="the training data differ from the checkpoint's"):
        trainer = Trainer(load_config(TINY, [*common, "train.steps=2"]), ParallelContext.single())
    assert trainer.step == 1 and trainer.data.tokenizer.name == saved["data"]["tokenizer"]


def test_a_bpe_run_of_a_small_vocabulary_resumes_by_auto_without_restating_its_size(tmp_path):
    """data.bpe_vocab_size (2048 by default) above model.vocab_size is refused, before the corpus is read, only where
    a BPE would be trained: not for a run going on with its checkpoint's tokenizer (checkpoint.resume=auto)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def alpha(x):\n    return x + 5\n" * 300)
    common = [f"log.run_dir={tmp_path / 'run'}", f"data.source={corpus}", "data.tokenizer=bpe", "model.vocab_size=300",
              f"data.cache_dir={tmp_path / 'cache'}", "checkpoint.resume=auto"]
    with pytest.raises(ConfigError, match="data.bpe_vocab_size=2048 is more than model.vocab_size=300, which must "
                                          "hold every token: lower data.bpe_vocab_size"):
        data_settings(load_config(TINY, common))  # nothing to resume yet
    train(load_config(TINY, [*common, "data.bpe_vocab_size=300", "train.steps=1"]))
    trainer = Trainer(load_config(TINY, [*common, "train.steps=2"]), ParallelContext.single())
    assert trainer.step == 1 and trainer.data.tokenizer.vocab_size <= 300


def test_a_run_resumed_from_an_earlier_step_moves_the_later_checkpoints_aside(tmp_path, capsys):
    run = tmp_path / "run"
    common = [f"log.run_dir={run}", "train.steps=6", "checkpoint.every=2", "checkpoint.keep=5", "log.tensorboard=true"]
    first = train(load_config(TINY, [*common, "log.trace=true"]))
    later = {p.name: (p / "model-00000.safetensors").read_bytes() for p in (run / "checkpoints").glob("step_*")
             if p.name > "step_0000002"}
    step2 = f"checkpoint.resume={run / 'checkpoints' / 'step_0000002'}"
    ledger, settings = (run / "comm_ledger.json").read_bytes(), (run / "config.yaml").read_bytes()
    with pytest.warns(UserWarning, match="no step left to train"):  # changes nothing, the ledger of 6 steps kept
        train(load_config(TINY, [*common, step2, "train.steps=2"]))
    assert (run / "checkpoints" / "latest").read_text() == "step_0000006" and not list(run.glob("*-before-*"))
    assert (run / "comm_ledger.json").read_bytes() == ledger and (run / "trace.json").is_file()
    assert (run / "config.yaml").read_bytes() == settings  # steps: 6, as trained
    with pytest.warns(UserWarning, match="no step left to train"):  # its checkpoints directory: its own too
        train(load_config(TINY, [*common, f"checkpoint.resume={run / 'checkpoints'}"]))
    assert (run / "checkpoints" / "latest").read_text() == "step_0000006" and not list(run.glob("*-before-*"))
    with (run / "metrics.jsonl").open("ab") as f:
        f.write(b"\xff\xfe damaged\n")
    replaced = run / "checkpoints" / ".step_0000006.old-99"  # a save of step 6 again, stopped between its renames
    (run / "checkpoints" / "step_0000006").rename(replaced)
    (run / "checkpoints" / "step_0000007").mkdir()  # incomplete, of a later step: moved aside too, not in the way
    with pytest.warns(UserWarning, match="goes on from step 2 of .* checkpoints of later steps: they and their "
                                         "lines of metrics.jsonl are moved to"):
        again = train(load_config(TINY, [*common, step2]))
    # the first launch's trace and pictures are not this one's, which has none
    assert not [p.name for p in run.iterdir() if p.name == "trace.json" or p.suffix == ".png"]
    assert "removed trace.json, timeline.png, mesh.png: an earlier launch of this run wrote them" in \
        capsys.readouterr().out
    (aside,) = run.glob("checkpoints-before-*")
    assert {p.name: (p / "model-00000.safetensors").read_bytes() for p in aside.glob("step_*")
            if p.name != "step_0000007"} == later and (aside / "step_0000007").is_dir()
    assert (aside / "latest").read_text() == "step_0000006" and not list(run.glob("checkpoints/.step_*"))
    assert [m["loss"] for m in read_metrics(aside)] == [m["loss"] for m in first[2:]]
    assert (run / "checkpoints" / "latest").read_text() == "step_0000006"
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4, 5, 6]  # steps 3 to 6 once, from the second run
    assert [m["loss"] for m in read_metrics(run)] == [m["loss"] for m in first[:2] + again]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tensorboard")).Reload().Scalars("loss")  # steps 3-6 once, the second run's
    assert [(e.step, e.value) for e in events] == [(m["step"], pytest.approx(m["loss"])) for m in read_metrics(run)]
    other = tmp_path / "other"  # resumed from another directory: this one's metrics begin anew
    train(load_config(TINY, [f"log.run_dir={other}", "train.steps=3"]))
    with pytest.warns(UserWarning, match=f"holds an earlier run: this one goes on from {run}/checkpoints/step_0000002"):
        train(load_config(TINY, [f"log.run_dir={other}", "train.steps=4",
                                 f"checkpoint.resume={run / 'checkpoints' / 'step_0000002'}"]))
    assert [m["step"] for m in read_metrics(other)] == [3, 4]


def test_rank_0_waits_for_a_background_save_while_the_files_grow(tmp_path):
    """checkpoint.async_save: rank 0 waits for the other rank's record of its files as long as the staging directory
    grows (here 3 s against parallel.timeout_s=1), and stops after that long without growth."""
    import threading
    import time
    from sixfold.mesh import ParallelContext, ParallelDims
    from sixfold.train_state import Saver
    cfg = load_config(TINY, ["parallel.timeout_s=1", f"log.run_dir={tmp_path}"])
    saver = Saver(ParallelContext.single(ParallelDims(dp_replicate=2)), None, cfg)
    tmp = tmp_path / "stage"
    tmp.mkdir()
    (tmp / ".files-00000.json").write_text("{}")

    def write() -> None:
        with open(tmp / "model-00001.safetensors", "wb") as f:
            for _ in range(6):
                f.write(b"x" * 100)
                f.flush()
                time.sleep(0.5)
        (tmp / ".files-00001.json").write_text('{"model-00001.safetensors": {}}')

    writer = threading.Thread(target=write)
    writer.start()
    assert saver._collect(tmp) == {"model-00001.safetensors": {}}
    writer.join()
    (tmp / ".files-00000.json").write_text("{}")
    with pytest.raises(CheckpointError, match=re.escape("1 rank(s) wrote nothing for parallel.timeout_s=1.0 s and "
                                                        "did not finish (.files-00001.json missing)")):
        saver._collect(tmp)
