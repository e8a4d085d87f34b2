"""The trainer end to end: run output, exact resume, checkpoint safety, clear errors."""
import contextlib
import errno
import fcntl
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from sixfold import cli, launch, ledger, parity
from sixfold import train as train_module
from sixfold.checkpoint import Checkpoint
from sixfold.config import ConfigError, load_config
from sixfold.logs import fmt_line, read_metrics
from sixfold.parity import LOSS_RTOL, WEIGHT_RTOL
from sixfold.slices import Reader
from sixfold.stop import Stopped, StopSignal
from sixfold.data import DataError, load_data
from sixfold.errors import CommError, collective
from sixfold.launch import HOLD
from sixfold.train import TrainingError, check_inputs, data_settings, train
from helpers import LONG, ROOT, TINY, children, free_port, multirun, sixfold, torchrun


def _train(run_dir, *overrides, nproc=None):
    args = ["train", TINY, f"log.run_dir={run_dir}", *overrides]
    return sixfold(*args, *(["--nproc", str(nproc)] if nproc else []))


def test_the_step_line_gives_memory_in_the_unit_of_its_value():
    """peak_mem_gb is in GiB (2**30 bytes): the line says so, not GB, 7% less a unit."""
    m = {"step": 3, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0, "peak_mem_gb": 80.0,
         "elapsed_s": 1.0}
    assert "| mem 80.00GiB |" in fmt_line(m)


def test_run_outputs(tmp_path):
    run = tmp_path / "run"
    proc = _train(run, "train.steps=4", "train.eval_every=2", "log.tensorboard=true", "log.progress=true",
                  "log.trace=true", "log.sample_tokens=20", "parallel.dp_shard=2", "parallel.zero=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(k in metrics[0] for k in ("loss", "grad_norm", "lr", "tokens_per_s", "elapsed_s"))
    assert "mfu" not in metrics[0] and 0.05 < metrics[0]["peak_mem_gb"] <= metrics[-1]["peak_mem_gb"] < 4  # a CPU's
    assert "val_loss" in metrics[1] and "val_loss" in metrics[3]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "config.yaml").is_file() and "dp_shard: 2" in (run / "config.yaml").read_text()
    assert "step     4 | loss" in proc.stderr + proc.stdout and "GiB | elapsed" in proc.stderr + proc.stdout
    assert "sample:\ndef " in proc.stdout + proc.stderr
    trace = json.loads((run / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert any(e.get("cat") == "comm" for e in trace["traceEvents"])
    assert (run / "timeline.png").stat().st_size > 10_000 and (run / "mesh.png").stat().st_size > 10_000
    assert sorted(ledger.read(run)["ranks"]) == ["0", "1"]
    gen = sixfold("generate", str(run), "--prompt", "-import ", "--max-new-tokens", "10")  # (no option: a text)
    assert gen.returncode == 0 and gen.stdout.startswith("-import "), gen.stderr[-2000:]
    gen = sixfold("generate", str(run), "--prompt", "import ", "--max-new-tokens", "300")  # max_seq_len 256
    assert gen.returncode == 0 and "leaves room for 249 after the prompt; at most 249 are generated" in gen.stderr
    gen = sixfold("generate", str(run), "--prompt", "a" * 300)
    assert gen.returncode == 2 and "sixfold error: --prompt is 300 tokens; give one of 1 to 256 tokens" in gen.stderr


def test_a_data_warning_is_said_once_when_the_launcher_starts_the_ranks(tmp_path):
    """The launcher reads the corpus before starting the ranks, and rank 0 reads it again from the cache; what the
    config and the data show is said by rank 0 alone."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a", "b", "c"):
        (corpus / f"{name}.txt").write_text(f"def {name}(x):\n    return x\n" * 400)
    (corpus / "d.txt").write_bytes(b"\xff\xfe" * 100)
    proc = _train(tmp_path / "run", "parallel.dp_replicate=2", "train.steps=1", f"data.source={corpus}",
                  f"data.cache_dir={tmp_path / 'cache'}", "train.eval_every=1", "train.eval_batches=50")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("skipped 1 file(s) that are not UTF-8 text") == 1, proc.stderr
    assert proc.stderr.count("train.eval_batches=50 batches of 8 sequences go round the val split") == 1, proc.stderr


def test_a_train_split_shorter_than_a_batch_is_said(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def f(x):\n    return x\n" * 8)
    cfg = load_config(TINY, [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.warns(UserWarning, match=re.escape(
            "the train split holds 5 sequence(s) of train.seq_len=32 tokens, fewer than train.global_batch=8: every "
            "batch holds some of them more than once; add data, or lower train.global_batch or train.seq_len")):
        check_inputs(cfg, load_data(data_settings(cfg)))


def test_a_train_split_too_short_for_a_window_names_data_val_fraction_where_the_val_split_holds_tokens(tmp_path):
    """Six files, one long one drawn to val at 0.2: the train split is the five short ones."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"d{i}.txt").write_text(f"short text {i}\n")
    (corpus / "d5.txt").write_text("long document " * 10 + "\n")
    overrides = [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=100"]
    cfg = load_config(TINY, [*overrides, "data.val_fraction=0.2"])
    with pytest.raises(DataError, match=re.escape(
            "the train split has fewer than seq_len+1 = 101 tokens (70); lower train.seq_len or add data (or raise "
            "data.max_bytes, if set); or lower data.val_fraction=0.2: the val split holds 142 tokens")):
        check_inputs(cfg, load_data(data_settings(cfg)))
    cfg = load_config(TINY, [*overrides, "data.val_fraction=0", "data.max_bytes=60"])
    with pytest.raises(DataError, match=r"\(65\); lower train.seq_len or add data \(or raise data.max_bytes, if "
                                        r"set\)$"):
        check_inputs(cfg, load_data(data_settings(cfg)))


def test_a_vocabulary_too_small_for_bytes_is_refused_before_the_corpus_is_read(tmp_path):
    cfg = load_config(TINY, ["model.vocab_size=200", f"data.source={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match=re.escape("model.vocab_size=200 is smaller than the tokenizer's 257 tokens "
                                                    "(data.tokenizer=byte); set model.vocab_size>=257")):
        data_settings(cfg)


def test_a_sample_longer_than_the_model_holds_is_said(tmp_path):
    cfg = load_config(TINY, [f"log.run_dir={tmp_path}", "log.sample_tokens=1000", "log.sample_prompt=def"])
    with pytest.warns(UserWarning, match=re.escape(
            "log.sample_tokens=1000: model.max_seq_len=256 leaves room for 253 after log.sample_prompt; the sample "
            "after training holds at most 253")):
        check_inputs(cfg, load_data(data_settings(cfg)))


RESUMED = {  # the last saves in the background
    "dp2": ["parallel.dp_replicate=2"], "zero3": ["parallel.dp_shard=2", "parallel.zero=3"],
    "zb-v": ["parallel.pp=2", "parallel.pp_schedule=zb-v", "parallel.pp_virtual_stages=2"],
    "tp2-zero3-async": ["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero=3", "checkpoint.async_save=true"]}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, str]:
    """Six steps of each layout of RESUMED, then each resumed from a copy of its step-3 checkpoint: one job for the
    whole runs, one for the resumed ones. Their directory, and the resumed job's output."""
    where = tmp_path_factory.mktemp("resume")
    (where / "full").mkdir()
    common = ["train.steps=6", "train.micro_batches=2"]
    multirun(where / "full", 4, {name: [*common, *layout, "checkpoint.every=3", "checkpoint.keep=5"]
                                 for name, layout in RESUMED.items()})
    for name in RESUMED:
        shutil.copytree(where / "full" / name / "checkpoints" / "step_0000003",
                        where / "resumed" / name / "checkpoints" / "step_0000003")
        (where / "resumed" / name / "checkpoints" / "latest").write_text("step_0000003")
    proc = multirun(where / "resumed", 4, {name: [*common, *layout, "checkpoint.resume=auto", "log.progress=true"]
                                           for name, layout in RESUMED.items()})
    return where, proc.stdout


@pytest.mark.parametrize("layout", list(RESUMED))
def test_resume_is_bit_exact(resumed, layout):
    """Resuming from step 3 in the same layout gives exactly the losses of the uninterrupted run."""
    (where, out), run = resumed, resumed[0] / "resumed" / layout
    assert f"\nfrom checkpoint {run / 'checkpoints' / 'step_0000003'}: step 3 of 6\n" in out, out[-3000:]
    assert "\ndata: 150 documents from 150 of " in out, out[-3000:]
    a, b = read_metrics(where / "full" / layout)[3:], read_metrics(run)
    assert [m["step"] for m in b] == [4, 5, 6]
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
    assert [m["grad_norm"] for m in a] == [m["grad_norm"] for m in b]
    steps = ledger.read(run)["ranks"]["0"]["steps"]  # written without log.trace, for the steps run
    assert (steps[0]["first"], steps[-1]["last"]) == (4, 6)


def _weights(run: Path) -> dict:
    return Reader(Checkpoint(run), "model").all()


def _matches(run: Path, reference: Path, first_step: int) -> None:
    """Steps from `first_step` on, and the final weights, equal the reference run's in fp32 round-off."""
    ours, theirs = read_metrics(run), read_metrics(reference)[first_step - 1:]
    assert [m["step"] for m in ours] == [m["step"] for m in theirs]
    assert all(abs(a["loss"] - b["loss"]) <= LOSS_RTOL * b["loss"] for a, b in zip(ours, theirs))
    final, expected = _weights(run), _weights(reference)
    for name, w in expected.items():
        assert (final[name] - w).norm() <= WEIGHT_RTOL * w.norm(), name


CHAIN = {  # each leg resumes from the previous leg's checkpoint two steps later than the one before
    "dense": (["model.n_layers=6", "model.tie_embeddings=true", "train.micro_batches=4", "train.global_batch=16"], [
        ["parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=2", "parallel.zero=3"],
        ["parallel.dp_shard=4", "parallel.zero=1"],
        ["parallel.tp=4", "parallel.sequence_parallel=false"],
        ["parallel.pp=4", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2"]]),
    "moe": (["model.moe_experts=4"], [
        ["parallel.dp_shard=2", "parallel.ep=2", "parallel.zero=1"],
        ["parallel.dp_shard=4", "parallel.ep=4", "parallel.zero=3"]]),
}


@pytest.mark.parametrize("model", list(CHAIN))
def test_a_checkpoint_moves_across_any_change_of_layout(tmp_path, model):
    """tp2 x pp2 x dp_shard2 zero3 -> dp4 zero1 -> tp4 -> pp4 interleaved (and ep2 -> ep4 for MoE): after each
    move the run goes on as the single-process run that never moved; the first checkpoint exports to HF."""
    common, legs = CHAIN[model]
    common = ["train.steps=8", "checkpoint.every=2", "checkpoint.keep=4", *common]
    runs = {"reference": common}
    for i, layout in enumerate(legs):
        resume = [f"checkpoint.resume={tmp_path / f'leg{i - 1}' / 'checkpoints' / f'step_{2 * i:07d}'}"] if i else []
        runs[f"leg{i}"] = [*common, *layout, *resume]
    multirun(tmp_path, max(load_config(TINY, overrides).parallel.world_size for overrides in runs.values()), runs)
    for i in range(len(legs)):
        _matches(tmp_path / f"leg{i}", tmp_path / "reference", 2 * i + 1)
    out = tmp_path / "hf"
    assert cli.main(["export-hf", str(tmp_path / "leg0"), str(out)]) == 0
    exported = load_file(str(out / "model.safetensors"))
    assert torch.equal(exported["model.embed_tokens.weight"], _weights(tmp_path / "leg0")["embed.weight"])


def test_bad_checkpoints(tmp_path):
    run = tmp_path / "run"
    assert _train(run, "train.steps=2").returncode == 0
    ckpt = run / "checkpoints" / "step_0000002"
    mismatch = _train(tmp_path / "b", "train.steps=3", "model.dim=128", "model.ffn_dim=352",
                      f"checkpoint.resume={ckpt}")
    assert mismatch.returncode == 2
    assert "embed.weight has shape (320, 64), the model expects (320, 128)" in mismatch.stderr
    fresh = _train(tmp_path / "fresh", "train.steps=1", "checkpoint.resume=auto")
    assert fresh.returncode == 0 and len(read_metrics(tmp_path / "fresh")) == 1
    missing = _train(tmp_path / "c", f"checkpoint.resume={tmp_path / 'nowhere'}")
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_nan_loss_stops_at_once_when_asked(tmp_path):
    proc = _train(tmp_path / "run", "train.lr=1e30", "train.grad_clip=0", "train.warmup_steps=0",
                  "train.steps=6", "train.skip_nonfinite=0", "checkpoint.every=1")
    assert proc.returncode == 2
    # the weights in memory may have diverged already: nothing is written, the newest checkpoint is named
    saved = tmp_path / "run" / "checkpoints" / "step_0000001"
    assert "not finite for 1 step(s) in a row (train.skip_nonfinite=0); the run stops here. Lower train.lr or " \
           f"check the data, then resume from the newest checkpoint before step 2: checkpoint.resume={saved}" \
           in proc.stderr
    assert [p.name for p in saved.parent.glob("step_*")] == ["step_0000001"]


def test_a_stop_on_nonfinite_steps_before_any_checkpoint_does_not_ask_for_checkpoints_already_asked_for(tmp_path):
    proc = _train(tmp_path / "run", "train.lr=1e30", "train.grad_clip=0", "train.warmup_steps=0",
                  "train.steps=6", "train.skip_nonfinite=0", "checkpoint.every=2")
    assert proc.returncode == 2
    assert "then start again: this run has no checkpoint from before them to resume from (checkpoint.every=2 wrote " \
           "none before step 2)" in proc.stderr, proc.stderr[-3000:]


def test_a_stop_on_nonfinite_steps_names_a_save_still_being_written_and_the_checkpoint_it_started_from(
        tmp_path, monkeypatch):
    """A background save of the step before is waited for, not lost with the process; a run resumed from another
    directory's checkpoint is told to go back to it."""
    from sixfold import checkpoint
    write = checkpoint.write_tensors
    monkeypatch.setattr(checkpoint, "write_tensors", lambda *a, **k: (time.sleep(0.5), write(*a, **k))[1])
    diverge = ["train.lr=1e30", "train.grad_clip=0", "train.warmup_steps=0", "train.skip_nonfinite=0",
               "train.steps=4"]
    first = tmp_path / "first"
    with pytest.raises(TrainingError) as e:
        train(load_config(TINY, [*diverge, "checkpoint.every=1", "checkpoint.async_save=true", f"log.run_dir={first}"]))
    saved = first / "checkpoints" / "step_0000001"
    assert f"before step 2: checkpoint.resume={saved}" in str(e.value) and (saved / "meta.json").is_file()
    with pytest.raises(TrainingError) as e:
        train(load_config(TINY, [*diverge, f"checkpoint.resume={saved}", f"log.run_dir={tmp_path / 'second'}"]))
    assert f"then resume from the newest checkpoint before step 2: checkpoint.resume={saved}" in str(e.value)
    third = tmp_path / "third"  # resumed from its own step 2, which checkpoint.keep=1 removed at step 3
    keep = ["checkpoint.every=1", "checkpoint.keep=1", f"log.run_dir={third}"]
    train(load_config(TINY, ["train.steps=2", *keep]))
    with pytest.warns(UserWarning), pytest.raises(TrainingError) as e:
        train(load_config(TINY, [*diverge, "checkpoint.resume=auto", *keep]))
    assert str(e.value).endswith(f"checkpoint.resume={third / 'checkpoints' / 'step_0000003'}")


def test_no_checkpoint_is_written_while_steps_are_skipped_so_the_good_ones_stay(tmp_path):
    """Steps 1-2 train; step 3's update diverges, steps 4-6 are skipped and the run stops. Checkpoints of the
    skipped steps would have pushed steps 1 and 2 out of checkpoint.keep=3; the error names step 3's, and step 2's
    in case step 3's update is what diverged."""
    run, every = tmp_path / "run", ["checkpoint.every=1", "checkpoint.keep=3", f"log.run_dir={tmp_path / 'run'}"]
    train_module.train(load_config(TINY, ["train.steps=2", *every]))
    with pytest.warns(UserWarning), pytest.raises(train_module.TrainingError) as e:
        train_module.train(load_config(TINY, ["train.steps=10", "train.lr=1e30", "train.grad_clip=0",
                                              "train.warmup_steps=0", "train.skip_nonfinite=2",
                                              "checkpoint.resume=auto", *every]))
    steps = run / "checkpoints"
    assert [p.name for p in sorted(steps.glob("step_*"))] == ["step_0000001", "step_0000002", "step_0000003"]
    assert f"resume from the newest checkpoint before step 4: checkpoint.resume={steps / 'step_0000003'} " \
           f"(should it fail the same way, the update of its own step may be what diverged: then " \
           f"checkpoint.resume={steps / 'step_0000002'})" in str(e.value)


def test_a_run_ending_in_skipped_steps_writes_no_final_checkpoint(tmp_path):
    """Within train.skip_nonfinite the run ends as planned, but its weights may have diverged: the final
    checkpoint is not written (it would push a good one out of checkpoint.keep), and the newest good one is named."""
    run = tmp_path / "run"
    every = ["checkpoint.every=1", "checkpoint.keep=2", f"log.run_dir={run}"]
    train_module.train(load_config(TINY, ["train.steps=2", *every]))
    steps = run / "checkpoints"
    with pytest.warns(UserWarning, match=f"no final checkpoint: the last 2 step\\(s\\) were not finite; .* "
                                         f"checkpoint.resume={steps / 'step_0000003'}"):
        train_module.train(load_config(TINY, ["train.steps=5", "train.lr=1e30", "train.grad_clip=0",
                                              "train.warmup_steps=0", "checkpoint.resume=auto", *every]))
    assert [p.name for p in sorted(steps.glob("step_*"))] == ["step_0000002", "step_0000003"]
    strict = [json.loads(line, parse_constant=pytest.fail) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in strict] == [False] * 3 + [True] * 2  # a NaN norm is null: strict JSON
    assert all(m["grad_norm"] is None for m in strict[3:]) and math.isnan(read_metrics(run)[3]["grad_norm"])


def test_a_model_too_large_to_build_says_its_size_and_what_to_change(tmp_path):
    from sixfold.mesh import ParallelContext
    # an embedding of 281 TB: more than a process can address, so refused however the system overcommits memory
    cfg = load_config(TINY, ["model.vocab_size=2147483647", "model.dim=32768", f"log.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="rank 0 ran out of memory building the model \\(140,743,965,507,584 "
                                          "parameters, 562,975.9 GB in fp32 before any sharding\\): choose smaller"):
        train_module.Trainer(cfg, ParallelContext.single())


def test_a_stop_during_skipped_steps_writes_no_checkpoint(tmp_path):
    """The weights may have diverged: as in the streak itself, nothing is written, and the newest checkpoint from
    before it is named."""
    from sixfold.mesh import ParallelContext
    run = tmp_path / "run"
    train_module.train(load_config(TINY, ["train.steps=2", "checkpoint.every=1", f"log.run_dir={run}"]))
    cfg = load_config(TINY, ["train.steps=9", "checkpoint.every=1", "checkpoint.resume=auto", f"log.run_dir={run}"])
    with pytest.warns(UserWarning):
        trainer = train_module.Trainer(cfg, ParallelContext.single())
    trainer.step, trainer.skipped = 4, 2  # steps 3 and 4 skipped
    said = str(trainer._stopped(False, "SIGTERM"))
    assert said == (f"stopped by SIGTERM after step 4 of 9; no checkpoint written: the last 2 step(s) were not "
                    f"finite; lower train.lr or check the data, then resume from the newest checkpoint before "
                    f"step 3: checkpoint.resume={run / 'checkpoints' / 'step_0000002'} (should it fail the same way, "
                    f"the update of its own step may be what diverged: then checkpoint.resume="
                    f"{run / 'checkpoints' / 'step_0000001'})")
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000001", "step_0000002"]


def test_layout_errors_before_any_process_starts(tmp_path):
    proc = _train(tmp_path / "run", "parallel.dp_replicate=2", nproc=3)
    assert proc.returncode == 2 and "world size 3 does not equal" in proc.stderr
    proc = _train(tmp_path / "run", "parallel.pp=8")
    assert proc.returncode == 2 and "model.n_layers to at least 6" in proc.stderr
    proc = sixfold("check", TINY, "train.grad_reduce=bf16")
    assert proc.returncode == 2 and "set train.grad_reduce=fp32" in proc.stderr
    proc = sixfold("check", TINY, "parallel.dp_replicate=2", "--workdir", "/proc/sixfold")
    assert proc.returncode == 2 and "--workdir=/proc/sixfold cannot be written" in proc.stderr, proc.stderr
    proc = sixfold("matrix", TINY, "--table", "/proc/sixfold/parity.md")  # before any layout runs
    assert proc.returncode == 2 and "--table's directory=/proc/sixfold cannot be written" in proc.stderr
    proc = sixfold("matrix", TINY, "--table", str(tmp_path / "parity.md"), "--only", "dp2")
    assert proc.returncode == 2 and "the table lists the whole matrix" in proc.stderr, proc.stderr
    proc = _train(tmp_path / "run", "parallel.dp_shrd=2")
    assert proc.returncode == 2 and "did you mean 'parallel.dp_shard'" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _train(tmp_path / "run", f"data.source={empty}")
    assert proc.returncode == 2 and "data" in proc.stderr


def test_check_command_prints_one_verdict(tmp_path):
    """Settings of its own runs that the check replaces are said to be unused."""
    proc = sixfold("check", TINY, "parallel.dp_replicate=2", "log.trace=true", "--steps", "2", "--workdir",
                   str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("parity OK: dp_replicate2, 2 steps")
    assert "sixfold check runs both sides its own way, without log.trace as given" in proc.stderr, proc.stderr
    again = sixfold("check", TINY, "parallel.dp_replicate=2", "--steps", "2", "--workdir", str(tmp_path))
    assert again.returncode == 2 and f"--workdir {tmp_path} holds an earlier check's runs (layout, reference); " \
        "remove them or give another --workdir" in again.stderr, again.stderr


def test_a_fine_tune_on_prompts_and_answers_keeps_parity_in_a_layout(tmp_path):
    """A prompt's tokens are no targets (IGNORE_INDEX): the layout counts the same targets as the single process,
    across pipeline stages, the vocabulary-parallel loss and context-parallel shards, and in the validation."""
    corpus = tmp_path / "qa.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": f"Q: {i} + {i}?\nA:", "answer": f" {2 * i}\n"}) + "\n"
                              for i in range(300)))
    proc = sixfold("check", TINY, f"data.source={corpus}", "data.jsonl_field=answer", "data.jsonl_prompt_field=prompt",
                   f"data.cache_dir={tmp_path / 'cache'}", "parallel.pp=2", "parallel.tp=2", "parallel.cp=2",
                   "train.micro_batches=2", "train.eval_every=3", "--steps", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("parity OK: pp2 x cp2 x tp2"), proc.stdout


def test_a_batch_of_prompts_only_is_skipped_and_a_validation_of_prompts_only_is_named(tmp_path):
    """Prompts far longer than a window: a batch may hold no answer token, and is skipped (no 0/0, no AdamW step on
    a zero gradient); a val split of prompts only is named before the first step."""
    corpus = tmp_path / "long.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": f"# {i}\n" + "x = 1\n" * 2000, "answer": "y"}) + "\n"
                              for i in range(20)))
    with pytest.warns(UserWarning) as said:
        history = train(load_config(TINY, [f"log.run_dir={tmp_path / 'run'}", f"data.source={corpus}",
                                           "data.jsonl_field=answer", "data.jsonl_prompt_field=prompt",
                                           f"data.cache_dir={tmp_path / 'cache'}", "train.steps=3",
                                           "train.eval_every=3", "data.val_fraction=0.05"]))
    said = [str(w.message) for w in said]
    assert any("the validation's 2 batch(es) hold prompts only (data.jsonl_prompt_field)" in m for m in said), said
    assert math.isnan(history[-1]["val_loss"])
    empty = [m for m in history if m.get("skipped")]
    assert empty and all(math.isnan(m["loss"]) and m["grad_norm"] == 0 for m in empty), history
    assert any(f"step {empty[0]['step']}: its batch holds prompts only, no token to learn" in m for m in said), said
    proc = sixfold("check", TINY, f"data.source={corpus}", "data.jsonl_field=answer", "data.jsonl_prompt_field=prompt",
                   f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.05", "train.micro_batches=2",
                   "--steps", "3")  # the skipped steps have no loss in either run
    assert proc.stdout.strip().splitlines()[-1].startswith("parity OK"), proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_step_that_only_one_run_has_a_loss_for_fails_parity(monkeypatch):
    """Skipped in both (a batch of prompts only, loss nan) agrees; a nan in one run only, at any step, does not;
    bf16 is compared at the last step with a loss."""
    reference = [{"loss": 6.0, "grad_norm": 2.0}, {"loss": 4.0, "grad_norm": 1.0},
                 {"loss": math.nan, "skipped": True, "grad_norm": 0.0}]
    layout = [{"loss": 6.0, "grad_norm": 2.0}, {"loss": math.nan, "skipped": True, "grad_norm": 0.0},
              {"loss": math.nan, "skipped": True, "grad_norm": 0.0}]
    monkeypatch.setattr(parity, "_weight_diff", lambda *dirs: (0.0, "head.weight"))
    for runs, rel in (((reference, reference), 0.0), ((layout, reference), math.inf)):
        monkeypatch.setattr(parity, "_steps", lambda *dirs: runs)
        assert parity.compare(None, None, "a layout").loss_rel == rel
    bf16 = [{"loss": 6.1, "grad_norm": 2.1}, {"loss": 4.02, "grad_norm": 1.1}, {"loss": math.nan, "skipped": True,
                                                                            "grad_norm": 0.0}]
    monkeypatch.setattr(parity, "_steps", lambda *dirs: (bf16, reference))  # bf16 learns: the steps with a loss
    learned = parity.compare_learning(None, None, "bf16")
    assert learned.loss_rel == pytest.approx(0.005) and "3 steps, last loss rel diff 5.00e-03 (tol" in learned.line()
    assert "3 steps, max loss rel diff 1.67e-02" in parity.compare(None, None, "bf16").line()  # fp32: every step


def test_a_gradient_norm_off_by_one_factor_fails_parity(monkeypatch):
    """A norm counted twice over replicas (sqrt(2) too large at every step) leaves AdamW's updates, and so the losses
    and weights, as they were: parity compares the norms themselves, at every step, and bf16 does not."""
    reference = [{"loss": 6.0, "grad_norm": 2.0}, {"loss": 4.0, "grad_norm": 1.0},
                 {"loss": math.nan, "skipped": True, "grad_norm": math.nan}]
    monkeypatch.setattr(parity, "_weight_diff", lambda *dirs: (0.0, "head.weight"))
    for norms, rel in (([2.0, 1.0, math.nan], 0.0), ([2.0, 1.0 + 5e-6, math.nan], 5e-6),
                       ([2.0 * math.sqrt(2), 1.0 * math.sqrt(2), math.nan], math.sqrt(2) - 1),
                       ([2.0, 1.0, 3.0], math.inf)):
        layout = [{**step, "grad_norm": norm} for step, norm in zip(reference, norms)]
        monkeypatch.setattr(parity, "_steps", lambda *dirs: (layout, reference))
        result = parity.compare(None, None, "a layout")
        assert result.loss_rel == 0 and result.norm_rel == pytest.approx(rel) and result.ok == (rel <= LOSS_RTOL)
        assert f"max grad-norm rel diff {result.norm_rel:.2e} (tol 1e-05)" in result.line()
        learned = parity.compare_learning(None, None, "bf16")
        assert learned.ok and "grad-norm" not in learned.line()
    monkeypatch.setattr(parity, "_steps", lambda *dirs: ([{"loss": 6.0, "grad_norm": 1.0}], [{"loss": 6.0,
                                                                                              "grad_norm": 0.0}]))
    assert parity.compare(None, None, "a layout").norm_rel == math.inf  # a norm where the reference had none


def test_final_weights_that_are_nan_or_missing_fail_parity(monkeypatch):
    """A nan compares as inf (a comparison with nan is false: it passed as 0); so does a parameter one checkpoint
    lacks; a reference of zeros is compared by the layout's RMS."""
    weights = {"layout": {"a": torch.full((4,), math.nan), "b": torch.ones(4)}, "reference": {"a": torch.ones(4),
                                                                                              "b": torch.ones(4)}}
    monkeypatch.setattr(parity, "Checkpoint", lambda run: run)
    monkeypatch.setattr(parity, "Reader", lambda run, kind: mock.Mock(all=lambda: weights[run]))
    assert parity._weight_diff("layout", "reference") == (math.inf, "a")
    weights["layout"] = {"b": torch.ones(4)}
    assert parity._weight_diff("layout", "reference") == (math.inf, "a, in the reference's checkpoint only")
    weights["layout"], weights["reference"] = {"z": torch.full((4,), 0.5)}, {"z": torch.zeros(4)}
    assert parity._weight_diff("layout", "reference") == (0.5, "z")


def test_check_removes_its_temporary_runs_when_parity_holds(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli.main(["check", TINY, "train.micro_batches=2", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("parity OK: single process, 1 steps") and len(out.splitlines()) == 1, out  # no runs' paths
    assert not list(tmp_path.iterdir())
    for argv, said in ((["checkpoint.resume=auto"], "checkpoint.resume=auto would not be used; leave it out"),
                       (["checkpoint.init=x"], "checkpoint.init=x would not be used; leave it out"),
                       ([], "sixfold check would compare the run with itself; give the layout to check"),
                       (["train.grad_reduce=bf16", "parallel.dp_shard=2"], "set train.grad_reduce=fp32"),
                       (["train.steps=2"], "runs --steps steps (now 5), not train.steps: give --steps instead"),
                       (["model.vocab_size=100", "parallel.tp=2"], "model.vocab_size=100 is smaller than the "
                                                                    "tokenizer's 257 tokens")):
        assert cli.main(["check", TINY, *argv]) == 2  # before any run starts: nothing in the temporary directory
        assert said in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_check_holds_a_bf16_layout_to_learn_like_fp32(tmp_path, monkeypatch, capsys):
    """50 steps by default: the last loss within 2% of the fp32 reference's, which fell by at least 1."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli.main(["check", TINY, "train.precision=bf16"]) == 0
    assert capsys.readouterr().out.startswith("parity OK: single process, 50 steps, last loss rel diff")
    assert cli.main(["check", TINY, "train.precision=bf16", "--steps", "2"]) == 2
    assert "not 1.0 lower: too few steps to tell whether bf16 learns (sixfold check: give more --steps)" in \
        capsys.readouterr().err


def test_nproc_0_is_refused(capsys):
    for command in ("train", "check"):
        with pytest.raises(SystemExit):
            cli.main([command, TINY, "--nproc", "0"])
        assert "argument --nproc: 0 must be at least 1" in capsys.readouterr().err


def test_a_checkpoints_top_k_is_refused_as_the_option_is():
    """A carried generation_config.json's top_k (sixfold generate's default) is checked as --top-k is."""
    assert cli._recommended({"top_k": 0}, "c") == {"top_k": 0}
    for top_k, said in ((-1, "must be at least 0"), (50.0, "is not an integer"), (True, "is not a number")):
        with pytest.raises(ConfigError, match=re.escape(f"c's generation_config.json has top_k={top_k!r}, which "
                                                        f"{said}; give --top-k")):
            cli._recommended({"top_k": top_k}, "c")


def test_check_stopped_by_a_signal_removes_its_temporary_runs(tmp_path, monkeypatch):
    """SIGTERM or Ctrl-C to `sixfold check` (its job stopped with it, launch.py) leaves nothing to look into."""
    from sixfold import parity

    def stopped(*args, **kwargs):
        raise Stopped("stopped by SIGTERM, and the job it ran with it", "SIGTERM")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(parity, "run_torchrun", stopped)
    with pytest.raises(Stopped):
        parity.check(load_config(TINY, ["parallel.dp_replicate=2"]), 1)
    assert not list(tmp_path.iterdir())


def test_running_out_of_memory_inside_a_collective_is_not_taken_for_a_failed_collective():
    """A collective's own allocation (NCCL's buffers, a CPU reduce-scatter's staging) that fails is running out of
    memory, which the step reports as such, not a group that failed."""
    for failed in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                   RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")):
        with pytest.raises(type(failed), match="memory"), collective("all_gather fsdp", (0, 1)):
            raise failed
    with pytest.raises(CommError, match="all_gather fsdp over ranks \\[0, 1\\] failed: Connection reset"):
        with collective("all_gather fsdp", (0, 1)):
            raise RuntimeError("Connection reset by peer")


def test_a_hung_peer_ends_the_collective_with_an_error_naming_its_group_and_the_rank_to_look_at():
    proc = torchrun("hang.py", 3)
    pid = re.search(r"rank 2 pid (\d+)", proc.stdout).group(1)
    lines = [line for line in proc.stdout.splitlines() if " stopped: " in line]
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"rank {rank} stopped: ")]
        assert [line.split(" over ")[0] for line in mine] == [
            f"rank {rank} stopped: {name}" for name in ("gather_object dp_replicate", "all_reduce dp_replicate grads",
                                                        "all_reduce dp_replicate loss" if rank == 0 else
                                                        "broadcast dp_replicate")], proc.stdout + proc.stderr[-2000:]
        assert all(f"; see its log. Rank 2 ({socket.gethostname()}, pid {pid}) did not fail with it within 3 s: it "
                   "died, hangs, or is busy elsewhere" in line and f"Rank {1 - rank} (" not in line
                   for line in mine), mine
        other = "rank 1 in broadcast dp_replicate." if rank == 0 else "rank 0 in all_reduce dp_replicate loss."
        assert [line.endswith(f"Failed in other collectives: {other}") for line in mine] == [False, False, True], mine


def test_a_roll_call_counts_each_failure_of_another_rank_once_even_one_written_before_its_last_call_ended():
    """Collectives after a timed-out one fail at once: rank 0 writes its second failure before rank 1's first roll
    call has ended, and rank 1's second roll call still finds it (a check by time alone passed it as an old one)."""
    import threading

    from sixfold.rollcall import RollCall

    store = torch.distributed.HashStore()
    calls = [RollCall(store, rank, timeout_s=1) for rank in (0, 1)]
    said: dict[int, list[str]] = {0: [], 1: []}

    def fail(rank: int) -> None:
        time.sleep(0.2 * rank)
        said[rank] += [calls[rank].absent(name, [0, 1, 2]) for name in ("all_reduce a", "all_reduce b")]

    threads = [threading.Thread(target=fail, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rank in (0, 1):
        assert said[rank] == [" Rank 2 (machine unknown) did not fail with it within 1 s: it died, hangs, or is busy "
                              "elsewhere for longer than parallel.timeout_s."] * 2, said


def test_a_rank_that_never_joins_ends_the_others_with_an_error_naming_the_timeout(tmp_path):
    """Rank 0 of 2 started alone (as when the other machine's ranks hang at start): the rendezvous times out."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-m", "sixfold.cli", "train", TINY, "parallel.dp_replicate=2",
                           "parallel.timeout_s=3", f"log.run_dir={tmp_path / 'run'}"], env=env, text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 2 and "sixfold error (rank 0): joining the job as rank 0 over ranks [0, 1] failed" \
        in proc.stderr and "started within parallel.timeout_s (3 s; raise it where they start further apart" \
        in proc.stderr, proc.stderr[-2000:]


def test_a_rank_started_without_the_jobs_environment_is_refused_naming_what_is_missing(tmp_path, monkeypatch):
    """A rank started by hand or by another launcher than torchrun: no traceback of a KeyError or of int(); without
    LOCAL_RANK (srun with RANK=$SLURM_PROCID), no job of its own started on this machine, apart from the others."""
    for given, said in ((["LOCAL_RANK=0"], "(rank 0): MASTER_ADDR and MASTER_PORT are not set: each rank of a job "
                                           "needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun sets them"),
                        ([], "(rank 0): WORLD_SIZE=2 makes this process one rank of a job of 2, and LOCAL_RANK, which "
                             "torchrun sets, is not set: sixfold train would start 2 ranks of its own here")):
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", **dict(g.split("=") for g in given)}
        proc = subprocess.run([sys.executable, "-m", "sixfold.cli", "train", TINY, "parallel.dp_replicate=2",
                               f"log.run_dir={tmp_path / 'run'}"], env=env, text=True, capture_output=True,
                              timeout=120)
        assert proc.returncode == 2 and proc.stderr.splitlines()[-1].startswith(f"sixfold error {said}"), \
            proc.stderr[-2000:]
    from sixfold.join import job_env, job_world
    job = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in job.items():
        monkeypatch.setenv(name, value)
    assert job_env() == (1, 2, "127.0.0.1", 29500) and job_world() == 2
    for name, value, said in (("WORLD_SIZE", "two", "WORLD_SIZE='two' is not a whole number of at least 1"),
                              ("RANK", "2", "RANK='2' is not a whole number from 0 to 1"),
                              ("MASTER_PORT", "0x10", "MASTER_PORT='0x10' is not a whole number from 1 to 65535"),
                              ("RANK", "", "RANK is not set")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError, match=f"^{said}: each rank of a job needs RANK"):
            job_world() if name == "WORLD_SIZE" else job_env()
        monkeypatch.setenv(name, job[name])


@pytest.mark.parametrize("what", ["sync", "async", "final"])
def test_a_full_disk_in_a_save_stops_every_rank_with_its_error(tmp_path, what):
    """The final checkpoint saved in the background is named only once it is in place."""
    start = time.monotonic()
    proc = torchrun("full_disk.py", 2, TINY, str(tmp_path / "run"), what)
    said = "the background checkpoint save failed: " if what != "sync" else ""
    step = tmp_path / "run" / "checkpoints" / f".step_000000{4 if what == 'final' else 2}.tmp"
    for rank in (0, 1):
        assert f"rank {rank} stopped: {said}rank 1: cannot write {step}/model-00001.safetensors: [Errno 28] No space " \
               f"left on device; make room there" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert time.monotonic() - start < 60 and not list((tmp_path / "run" / "checkpoints").iterdir())
    assert f"checkpoint: {tmp_path}" not in proc.stdout


def test_a_full_disk_in_the_metrics_stops_every_rank_after_the_step(tmp_path):
    start = time.monotonic()
    proc = torchrun("full_disk.py", 2, TINY, str(tmp_path / "run"), "metrics")
    for rank in (0, 1):
        assert f"rank {rank} stopped: rank 0 cannot write {tmp_path / 'run' / 'metrics.jsonl'} at step 3: [Errno 28] " \
               "No space left on device; make room there (or set log.run_dir elsewhere), then run the same command " \
               "with checkpoint.resume=auto" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert time.monotonic() - start < 60 and [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["latest", "step_0000002"]


def test_a_full_disk_under_tensorboard_stops_as_one_under_metrics_jsonl(tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    def full(*args, **kwargs):  # as its writer's thread reports a failed write, at the next scalar
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    with pytest.raises(TrainingError, match=f"rank 0 cannot write {tmp_path / 'run' / 'tensorboard'} at step 1: .*No "
                                            "space left on device; make room there"):
        train_module.train(load_config(TINY, [f"log.run_dir={tmp_path / 'run'}", "train.steps=2",
                                              "log.tensorboard=true", "log.progress=false"]))


def test_a_full_disk_at_the_summaries_says_the_training_is_done(tmp_path, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train_module, "write_chrome_trace", full)
    with pytest.raises(TrainingError, match=f"cannot write the run's summaries .* in {tmp_path / 'run'}: .*No space "
                                            "left on device; the training and its checkpoints are done"):
        train_module.train(load_config(TINY, [f"log.run_dir={tmp_path / 'run'}", "train.steps=2", "log.trace=true",
                                              "log.progress=false"]))
    assert (tmp_path / "run" / "checkpoints" / "step_0000002").is_dir()


@pytest.mark.parametrize("slow", ["pictures", "save", "async", "resume"])
def test_ranks_wait_for_rank_0_drawing_the_pictures_saving_or_resuming_beyond_the_timeout(tmp_path, slow):
    proc = torchrun("slow_rank0.py", 2, TINY, str(tmp_path / "run"), slow)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count(" done") == 2 and (tmp_path / "run" / "timeline.png").is_file()
    assert (tmp_path / "run" / "checkpoints" / "step_0000002").is_dir()


def test_a_full_disk_while_preparing_a_resume_is_said_and_loses_nothing(tmp_path, monkeypatch):
    """Resumed from an earlier step, the later checkpoints go aside with their lines of metrics.jsonl: a failure to
    write those leaves both in place, for the same command to move them once there is room."""
    run = tmp_path / "run"
    common = [f"log.run_dir={run}", "checkpoint.every=2", "log.progress=false", "train.steps=4",
              f"checkpoint.resume={run / 'checkpoints' / 'step_0000002'}"]
    first = train_module.train(load_config(TINY, common[:-1]))
    before = (run / "metrics.jsonl").read_bytes()

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr("sixfold.logs.write_text", full)
        with pytest.raises(TrainingError, match=f"cannot prepare {run} for this run: .*No space left on device; make "
                                                "room there \\(or set log.run_dir elsewhere\\), then run the same"):
            train_module.train(load_config(TINY, common))
    assert (run / "metrics.jsonl").read_bytes() == before and not list(run.glob("checkpoints-before-*"))
    assert (run / "checkpoints" / "step_0000004").is_dir()
    with pytest.warns(UserWarning, match="goes on from step 2"):
        train_module.train(load_config(TINY, common))
    (aside,) = run.glob("checkpoints-before-*")
    assert read_metrics(aside) == first[2:] and (aside / "step_0000004").is_dir()


def test_ranks_that_do_not_share_the_run_directory_are_refused_before_training(tmp_path):
    proc = torchrun("unshared.py", 2, TINY, str(tmp_path))
    for rank in (0, 1):
        assert f"rank {rank} refused: rank 1 on " in proc.stdout and f"does not see {tmp_path}/machine1/run/.shared-" \
               in proc.stdout and f"wrote into {tmp_path}/machine0/run: the ranks of several machines need one " \
               "log.run_dir that all of them share" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert not (tmp_path / "machine0" / "run" / "metrics.jsonl").exists()
    assert [p.name for p in (tmp_path / "machine0" / "run").iterdir()] == [".lock"]


def test_ranks_that_read_other_data_are_refused_before_training(tmp_path):
    proc = torchrun("unshared_data.py", 2, TINY, str(tmp_path))
    for rank in (0, 1):
        assert f"rank {rank} refused: rank 1 read other data than rank 0 (" in proc.stdout and "give every machine " \
               "the same data.source files and data.tokenizer" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_non_finite_steps_are_skipped_then_the_run_stops(tmp_path):
    proc = _train(tmp_path / "run", "train.lr=1e30", "train.grad_clip=0", "train.warmup_steps=0", "train.steps=8",
                  "train.skip_nonfinite=2", "checkpoint.save_final=false")
    assert proc.returncode == 2
    assert "not finite for 3 step(s) in a row (train.skip_nonfinite=2)" in proc.stderr and "train.lr" in proc.stderr
    assert "start again: this run has no checkpoint from before them to resume from" in proc.stderr
    skipped = [m["skipped"] for m in read_metrics(tmp_path / "run")]
    assert skipped[-2:] == [True, True] and not skipped[0]


def _start(run: Path, *overrides: str, restarts: int = 0) -> tuple[subprocess.Popen, list[int]]:
    """LONG on 2 ranks under torchrun, resuming from the run directory's latest checkpoint if any; once it has
    logged 3 steps, its two workers' pids."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={restarts}", f"--log-dir={run.parent / 'torchrun'}", "-m", "sixfold.cli", "train", TINY,
           f"log.run_dir={run}", "checkpoint.resume=auto", *LONG, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    while job.poll() is None and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    workers = children(job.pid)
    assert job.poll() is None and len(workers) == 2, "the run ended before a rank could be stopped"
    return job, workers


def test_a_killed_rank_restarts_the_job_which_resumes_and_ends_as_if_never_stopped(tmp_path, uninterrupted):
    """torchrun --max-restarts: SIGKILL one rank mid-run; the restarted job resumes from the latest checkpoint
    and ends with the uninterrupted run's final loss."""
    run = tmp_path / "killed"
    job, workers = _start(run, "checkpoint.every=3", restarts=1)
    os.kill(max(workers), signal.SIGKILL)
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    assert "exitcode: -9" in err  # torchrun saw the kill and restarted the job
    steps = read_metrics(run)  # steps after the last checkpoint may appear twice
    assert sorted({m["step"] for m in steps}) == list(range(1, 31))
    assert steps[-1]["loss"] == uninterrupted


def test_sigterm_ends_the_run_with_a_checkpoint_and_it_goes_on_as_if_never_stopped(tmp_path, uninterrupted):
    """A scheduler's preemption, sent to one rank only (no periodic checkpoints): both ranks finish the same
    step, its checkpoint is written, and each exits with 128 + SIGTERM saying how to go on; run again with
    checkpoint.resume=auto, it ends with the uninterrupted run's final loss."""
    run = tmp_path / "stopped"
    job, workers = _start(run)
    os.kill(max(workers), signal.SIGTERM)
    out, err = job.communicate(timeout=300)
    last = read_metrics(run)[-1]["step"]
    assert job.returncode != 0 and last < 30, err[-3000:]
    assert err.count(f"sixfold: stopped by SIGTERM after step {last} of 30; checkpoint ") == 1, err[-3000:]
    assert "checkpoint.resume=auto" in err and "(rank " not in err  # said once, by the first rank
    assert (run / "checkpoints" / "latest").read_text() == f"step_{last:07d}"
    assert not (run / "comm_ledger.json").exists()  # the summaries come at a run's end only (docs/guide)
    assert _train(run, *LONG, "checkpoint.resume=auto", nproc=2).returncode == 0
    steps = read_metrics(run)
    assert [m["step"] for m in steps] == list(range(1, 31))
    assert steps[-1]["loss"] == uninterrupted


def _heard(sig: signal.Signals) -> str:
    """What StopSignal notes of `sig` sent to this process."""
    with StopSignal() as stop:
        os.kill(os.getpid(), sig)
        for _ in range(50):  # Python runs the handler between bytecodes, after the kill returns
            if stop.received:
                break
            time.sleep(0.01)
    return stop.received


def test_sigterm_sigint_and_sighup_are_noted_while_training_and_the_handlers_before_put_back():
    """Unless ignored when training starts (SIGHUP under nohup): then it stays ignored."""
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    before = [signal.getsignal(sig) for sig in signals]
    try:
        for sig in signals:
            signal.signal(sig, signal.SIG_DFL)
            assert _heard(sig) == sig.name and signal.getsignal(sig) is signal.SIG_DFL
            signal.signal(sig, signal.SIG_IGN)
            assert _heard(sig) == "" and signal.getsignal(sig) is signal.SIG_IGN
    finally:
        for sig, handler in zip(signals, before):
            signal.signal(sig, handler)


def test_a_signal_ends_an_evaluation_between_its_batches(tmp_path):
    """A long evaluation does not hold up a preemption: a signal heard before a batch ends it without a loss."""
    from sixfold.config import load_config
    from sixfold.mesh import ParallelContext
    from sixfold.train import Trainer
    trainer = Trainer(load_config(TINY, [f"log.run_dir={tmp_path}", "train.eval_every=1", "train.eval_batches=3"]),
                      ParallelContext.single())
    forwards = []
    real = trainer.model.loss_sum
    trainer.model.loss_sum = lambda *a: forwards.append(1) or real(*a)
    stop = StopSignal()
    assert trainer.evaluate(stop) > 0 and len(forwards) == 3
    stop.received = "SIGTERM"
    assert trainer.evaluate(stop) is None and len(forwards) == 3


def test_a_signal_after_the_last_step_ends_the_run(tmp_path, monkeypatch):
    """One heard during the final save ends the run once its checkpoint is in place, with the signal's exit code;
    one during the sample (which may be long) cuts it short, and the summaries are written; one while the
    summaries are written ends the run once they are whole."""
    from sixfold import checkpoint, generate
    write = checkpoint.write_tensors
    monkeypatch.setattr(checkpoint, "write_tensors", lambda *a, **k: (os.kill(os.getpid(), signal.SIGTERM),
                                                                      time.sleep(0.1), write(*a, **k))[2])
    run = tmp_path / "run"
    with pytest.raises(Stopped, match="stopped by SIGTERM after the last step \\(2 of 2\\)") as e:
        train(load_config(TINY, [f"log.run_dir={run}", "train.steps=2"]))
    assert e.value.exit_code == 143 and (run / "checkpoints" / "step_0000002" / "meta.json").is_file()
    monkeypatch.setattr(checkpoint, "write_tensors", write)
    drawn, pick = [], generate.pick
    monkeypatch.setattr(generate, "pick", lambda *a: (drawn.append(os.kill(os.getpid(), signal.SIGINT)), pick(*a))[1])
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job ignores it)
    try:
        with pytest.raises(Stopped, match="stopped by SIGINT at the run's end \\(the sample cut short\\), its "
                                          "checkpoint .*step_0000002 and its summaries written") as e:
            train(load_config(TINY, [f"log.run_dir={tmp_path / 'again'}", "train.steps=2", "log.sample_tokens=30"]))
    finally:
        signal.signal(signal.SIGINT, before)
    assert e.value.exit_code == 130 and len(drawn) == 1 and ledger.read(tmp_path / "again")["layout"]
    monkeypatch.setattr(generate, "pick", pick)
    written = ledger.write
    monkeypatch.setattr(ledger, "write", lambda *a: (os.kill(os.getpid(), signal.SIGTERM), written(*a))[1])
    with pytest.raises(Stopped,
                       match="stopped by SIGTERM at the run's end, its checkpoint .* and its summaries written"):
        train(load_config(TINY, [f"log.run_dir={tmp_path / 'third'}", "train.steps=2"]))
    assert ledger.read(tmp_path / "third")["layout"]


def _launch(run: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`sixfold train --nproc 2` of LONG, once it has logged 3 steps; its output unbuffered. It takes SIGINT as in a
    terminal, whether or not these tests ignore it (as a shell's background job does, which the launcher keeps)."""
    cmd = [sys.executable, "-m", "sixfold.cli", "train", TINY, f"log.run_dir={run}", *LONG, *args, "--nproc", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    job = subprocess.Popen(cmd, cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = run / "metrics.jsonl"
    while job.poll() is None and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    return job


@pytest.mark.parametrize("presses", [1, 3])
def test_ctrl_c_to_the_launcher_stops_its_ranks_after_a_step_with_a_checkpoint(tmp_path, presses):
    """`sixfold train --nproc 2` passes SIGINT (or SIGTERM) on to torchrun, which sends it to the ranks: they end
    as under a scheduler's preemption instead of running on or dying mid-step. Pressed again, the launcher says it
    is stopping already (once) and passes nothing more on."""
    run = tmp_path / "run"
    job = _launch(run)
    for _ in range(presses):  # apart: a signal sent while the same one is pending is merged with it
        job.send_signal(signal.SIGINT)
        time.sleep(0.1)
    out, err = job.communicate(timeout=300)
    last = read_metrics(run)[-1]["step"]
    assert job.returncode == 128 + signal.SIGINT and last < 30 and "Traceback" not in err, err[-3000:]
    assert err.count(f"stopped by SIGINT after step {last} of 30; checkpoint ") == 1, err[-3000:]
    assert err.count("sixfold: stopping on SIGINT already") == (presses > 1), err[-3000:]
    assert (run / "checkpoints" / "latest").read_text() == f"step_{last:07d}"


def test_the_launcher_passes_on_every_signal(tmp_path):
    """The launcher passes on each signal (torchrun, sixfold.launch's, notes the later ones and waits on for its
    ranks), saying once that it is stopping already: a job that counts the SIGINTs it hears hears three."""
    ready = tmp_path / "ready"
    counter = ("import signal, sys, time\nheard = []\nsignal.signal(signal.SIGINT, lambda *a: heard.append(1))\n"
               "open(sys.argv[1], 'w').close()\ntime.sleep(3)\nsys.exit(len(heard))\n")
    # SIGINT taken as in a terminal: a shell's background job (a suite run with `&`) starts with it ignored
    launcher = ("import os, signal, sys\nfrom sixfold.launch import _run\n"
                "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                f"sys.exit(_run([sys.executable, '-c', {counter!r}, {str(ready)!r}], dict(os.environ), False, False)"
                ".returncode)")
    job = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    while job.poll() is None and not ready.exists():
        time.sleep(0.02)
    for _ in range(3):  # apart, as in the test above
        job.send_signal(signal.SIGINT)
        time.sleep(0.1)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 3 and err.count("sixfold: stopping on SIGINT already") == 1, err


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_as_the_ranks_start_stops_them(tmp_path, presses):
    """Ctrl-C that reaches torchrun while it starts the ranks, before it has noted them (where its own handler
    ended it and left them training unseen), stops them once all have started: none trains a step. torchrun waits
    there (HOLD) until the signal has come; a second press changes nothing."""
    run, held = tmp_path / "run", tmp_path / "held"
    cmd = [sys.executable, "-m", "sixfold.cli", "train", TINY, f"log.run_dir={run}", *LONG, "--nproc", "2"]
    job = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", HOLD: str(held)},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    while job.poll() is None and not held.exists():
        time.sleep(0.02)
    for _ in range(presses):
        job.send_signal(signal.SIGINT)
        time.sleep(0.1)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 128 + signal.SIGINT and not (run / "metrics.jsonl").exists(), err[-3000:]
    lines = err.splitlines()  # (in either order: the launcher says it is stopping already as torchrun ends)
    assert len(lines) == presses and lines.count("sixfold: stopped by SIGINT as the ranks started") == 1, err[-3000:]
    assert err.count("sixfold: stopping on SIGINT already") == presses - 1, err[-3000:]


def test_ctrl_c_as_torchrun_starts_is_heard_once_it_takes_signals(tmp_path):
    """SIGINT that reaches sixfold's torchrun as Python starts, before torchrun() takes signals (where Python's start
    ended it with a traceback of its own and exit code 1), is kept, blocked as the launcher starts it, and heard
    then: one line, 130. Sent by the process to itself before it runs Python."""
    hold = launch._end_with_parent(hold=True)

    def start():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        hold()
        os.kill(os.getpid(), signal.SIGINT)
    cmd = [sys.executable, "-m", "sixfold.launch", "--standalone", "--nproc-per-node=1", "-m", "sixfold.cli", "train",
           TINY, f"log.run_dir={tmp_path}", "train.steps=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=120, preexec_fn=start)
    assert (proc.returncode, proc.stderr) == (130, "sixfold: stopped by SIGINT before any rank started\n"), proc.stderr


def test_a_closed_terminal_stops_the_run_after_a_step_with_a_checkpoint(tmp_path):
    """`sixfold train --nproc 2` in a terminal that closes (an ssh session dropped): SIGHUP to the launcher, which
    passes it on, and rank 0's writes to the terminal fail; the ranks end as under a preemption, exit code 129."""
    run = tmp_path / "run"
    terminal, tty = os.openpty()

    def in_the_terminal():  # a session of its own, the terminal its controlling one, SIGHUP not ignored
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)

    job = subprocess.Popen([sys.executable, "-m", "sixfold.cli", "train", TINY, f"log.run_dir={run}", *LONG,
                            "log.every=1", "--nproc", "2"], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdin=tty, stdout=tty, stderr=tty, start_new_session=True, preexec_fn=in_the_terminal)
    os.close(tty)
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 300
    try:
        with contextlib.suppress(OSError):  # its output read until 3 steps are logged
            while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
                assert time.monotonic() < deadline, "no 3 steps within 300 s"
                if select.select([terminal], [], [], 1)[0] and not os.read(terminal, 65536):
                    break
        os.close(terminal)  # the terminal closes: SIGHUP to the session in it
        code = job.wait(timeout=300)
    finally:
        job.kill()  # if still there: Linux sends its torchrun SIGTERM, which stops the ranks
    last = read_metrics(run)[-1]["step"]
    assert code == 128 + signal.SIGHUP and last < 30
    assert (run / "checkpoints" / "latest").read_text() == f"step_{last:07d}"


def test_a_closed_output_pipe_leaves_the_run_training_to_its_end(tmp_path):
    """`sixfold train ... | head`: once the reader has gone, rank 0's output goes nowhere, said once on stderr, and
    every step is trained and logged to metrics.jsonl."""
    run = tmp_path / "run"
    job = _launch(run, "log.every=1")
    job.stdout.close()
    err = job.stderr.read()
    assert job.wait(timeout=300) == 0 and "Traceback" not in err, err[-3000:]
    assert err.count("sixfold: stdout has gone (its reader ended or its terminal hung up)") == 1, err[-3000:]
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 31))
    assert (run / "checkpoints" / "latest").read_text() == "step_0000030"


def test_output_and_a_progress_bar_into_a_pipe_closed_at_the_start_leave_the_run_training_to_its_end(tmp_path):
    """`sixfold train ... 2>&1 | head -0`: the config printed as the run begins finds no reader, nor the bar."""
    run = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "sixfold.cli", "train", TINY, f"log.run_dir={run}", *LONG,
                            "log.progress=true"], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    job.stdout.close()
    assert job.wait(timeout=300) == 0
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 31))


def test_a_command_whose_output_pipe_closes_ends_as_a_pipes_writer_does():
    job = subprocess.Popen([sys.executable, "-m", "sixfold.cli", "plan", "configs/llama3-8b.yaml", "--gpus", "8",
                            "parallel.tp=8"],
                           cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    job.stdout.close()
    err = job.stderr.read()
    assert job.wait(timeout=120) == 128 + signal.SIGPIPE and err == "", err[-3000:]


def test_killing_the_launcher_outright_stops_its_ranks_after_a_step_with_a_checkpoint(tmp_path):
    """SIGKILL to `sixfold train --nproc 2` cannot be passed on; Linux sends torchrun SIGTERM when it dies, so the
    ranks end as under a preemption instead of training on unseen (the pipe they write to closes when they end)."""
    run = tmp_path / "run"
    job = _launch(run)
    job.kill()
    out, err = job.communicate(timeout=300)
    last = read_metrics(run)[-1]["step"]
    assert last < 30 and err.count(f"stopped by SIGTERM after step {last} of 30; checkpoint ") == 1, err[-3000:]
    assert (run / "checkpoints" / "latest").read_text() == f"step_{last:07d}"


def test_a_ranks_error_ends_the_launcher_with_its_exit_code_and_no_torchrun_traceback(tmp_path):
    proc = _train(tmp_path / "run", "parallel.dp_shard=2", "train.lr=1e9", "train.skip_nonfinite=0",
                  "train.steps=3", nproc=2)
    assert proc.returncode == 2 and proc.stderr.count("sixfold error: loss nan") == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "torch.distributed.elastic" not in proc.stderr


def test_a_job_a_signal_ended_exits_as_a_shell_reports_it():
    """torchrun ended by a signal as it starts (before it handles them): 143, not the -15 that sys.exit made 241."""
    from sixfold.launch import _run
    ended = _run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], dict(os.environ),
                 capture=False, stops=False)
    assert ended.returncode == 128 + signal.SIGTERM


def test_a_rank_ended_by_a_signal_is_named_by_the_launcher(tmp_path):
    """kill -9 of one rank (as the out-of-memory killer does): it cannot say anything itself, so the launcher
    names it and says how to go on, with the shell's exit code for the signal. torchrun's directory of the ranks'
    error files is not left behind in the temporary directory."""
    run, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    job = _launch(run, env={"TMPDIR": str(tmp)})
    (torchrun_pid,) = children(job.pid)
    worker = max(children(torchrun_pid))
    os.kill(worker, signal.SIGKILL)
    out, err = job.communicate(timeout=300)
    assert job.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert f"sixfold error: rank 1 (pid {worker}) was ended by SIGKILL (the kernel's out-of-memory killer" in err, \
        err[-3000:]
    assert "checkpoint.resume=auto" in err and "torch.distributed.elastic" not in err
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "sixfold_torchrun_"))]


def test_what_the_data_refuses_is_refused_before_the_ranks_start(tmp_path):
    corpus = tmp_path / "small.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 100)
    small = [f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}"]
    cases = [(["model.vocab_size=200"], "model.vocab_size=200 is smaller than the tokenizer's 257 tokens"),
             ([*small, "train.eval_every=5"], "the val split has fewer than seq_len+1"),
             ([*small, "model.max_seq_len=4096", "train.seq_len=4000"], "the train split has fewer than"),
             ([*small, "data.max_bytes=10"], "the train split has fewer than seq_len+1 = 33 tokens (10); lower "
              "train.seq_len or add data (or raise data.max_bytes, if set)"),
             ([f"checkpoint.resume={tmp_path / 'nowhere'}"],
              f"checkpoint.resume: checkpoint path {tmp_path / 'nowhere'} does not exist"),
             (["checkpoint.resume=auto", f"checkpoint.init={tmp_path / 'nowhere'}"],
              f"checkpoint.init: checkpoint path {tmp_path / 'nowhere'} does not exist"),
             (["log.sample_tokens=5", "log.sample_prompt=" + "x" * 300], "log.sample_prompt is 300 tokens, more than "
              "model.max_seq_len=256")]
    for overrides, message in cases:
        proc = _train(tmp_path / "runs" / "run", "parallel.dp_shard=2", *overrides)
        assert proc.returncode == 2 and f"sixfold error: {message}" in proc.stderr, proc.stderr[-2000:]
        assert "torch.distributed" not in proc.stderr  # no rank started
        assert not (tmp_path / "runs").exists()  # the directories the command made, removed
    (tmp_path / "mine").mkdir()  # one the user made is theirs
    assert _train(tmp_path / "mine", *cases[-1][0]).returncode == 2 and (tmp_path / "mine").is_dir()


def test_a_data_error_under_plain_torchrun_is_one_line_per_rank(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = torchrun("sixfold.cli", 2, "train", TINY, f"log.run_dir={tmp_path / 'run'}", f"data.source={empty}",
                    "parallel.dp_replicate=2", timeout=120)
    assert f"sixfold error (rank 0): data.source='{empty}': {empty} holds no files" in proc.stderr, proc.stderr
    assert "sixfold error (rank 1): rank 1 stopped waiting for the machines' first ranks to run: 1 rank(s) failed " \
           "(see its log)" in proc.stderr, proc.stderr
    assert "PeerStopped" not in proc.stderr


def test_nproc_starts_the_ranks(tmp_path):
    proc = _train(tmp_path / "run", "parallel.dp_replicate=2", "train.steps=2", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_metrics(tmp_path / "run")) == 2


@pytest.mark.parametrize("mode", ["ok", "fail-first", "fail-last", "hang-first", "hang-waiting"])
def test_ranks_wait_for_the_first_rank_loading_beyond_the_timeout(tmp_path, mode):
    proc = torchrun("local_first.py", 3, str(tmp_path), mode, timeout=60)
    if mode == "ok":
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.count("local_first OK") == 3
        return
    if mode == "hang-first":  # rank 0 silent: the others stop on their own, after parallel.timeout_s (2 s)
        for rank in (1, 2):
            assert f"rank {rank} stopped waiting for the machines' first ranks to run: another rank died or did " \
                   "not answer within parallel.timeout_s (2 s)" in proc.stdout, proc.stdout + proc.stderr[-3000:]
        return
    if mode == "hang-waiting":  # rank 2 silent: rank 0 stops its minute of work, rank 1 its wait
        assert "rank 0 stopped (one of the machines' first ranks to run): another rank died or did not answer " \
               "within parallel.timeout_s (2 s)" in proc.stdout, proc.stdout + proc.stderr[-3000:]
        assert "rank 1 stopped waiting for the machines' first ranks to run" in proc.stdout, proc.stdout
        assert not (tmp_path / "first-done").exists()
        return
    failed = 0 if mode == "fail-first" else 2
    assert f"rank {failed} corpus broken" in proc.stdout, proc.stderr[-3000:]
    stopped = {1: "waiting for the machines' first ranks to run", 2: "waiting for the machines' first ranks to run"} \
        if mode == "fail-first" else {0: "waiting for the other ranks to run", 1: "(one of the other ranks to run)"}
    for rank, how in stopped.items():
        assert f"rank {rank} stopped {how}: 1 rank(s) failed (see its log)" in proc.stdout, proc.stdout


def test_ctrl_c_outside_the_training_steps_is_one_line(monkeypatch, capsys):
    from sixfold import cli

    def interrupted(args, argv):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "cmd_trace", interrupted)
    assert cli.main(["trace", "anywhere"]) == 128 + signal.SIGINT
    assert capsys.readouterr().err == "sixfold: interrupted by SIGINT\n"


PROBE = """import importlib.abc, os, runpy, signal, sys
MODULE = sys.argv[1]
class Probe(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == MODULE:
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, Probe())
sys.argv = ["sixfold", "trace", "anywhere"]
runpy.run_module("sixfold.cli", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("module, code, err", [
    ("sixfold.config", -signal.SIGINT, ""),  # as the program's modules are imported: torchrun says the line
    ("sixfold.benchjob", 128 + signal.SIGINT, "sixfold: interrupted by SIGINT\n")])  # in main(), as the command runs
def test_ctrl_c_as_a_rank_imports_its_modules_ends_it_unsaid(module, code, err):
    """`python -m sixfold.cli` (a rank under torchrun) that SIGINT reaches as it imports sixfold.cli (sent as the
    import of MODULE begins) ends as the signal's default does, not with a traceback; once main() runs, with its
    one line."""
    proc = subprocess.run([sys.executable, "-c", PROBE, module], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (proc.returncode, proc.stderr) == (code, err), proc.stderr[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_before_the_first_step_is_one_line_too(sig, monkeypatch, capsys):
    """As Ctrl-C is (their default had ended the process at once, with nothing said and no clean-up); the handlers
    are put back as the command ends."""
    from sixfold import cli

    def signalled(args, argv):
        os.kill(os.getpid(), sig)
        raise AssertionError(f"{sig.name} did not interrupt")  # (its handler raises as os.kill returns)
    monkeypatch.setattr(cli, "cmd_train", signalled)
    before = signal.signal(sig, signal.SIG_DFL)  # (under nohup SIGHUP is ignored, and stays so)
    try:
        assert cli.main(["train", TINY]) == 128 + sig
        assert signal.getsignal(sig) is signal.SIG_DFL
    finally:
        signal.signal(sig, before)
    assert capsys.readouterr().err == f"sixfold: interrupted by {sig.name} outside the training steps: as the run " \
                                      f"started (nothing saved) or as it ended (all written)\n"



def test_settings_of_a_dimension_of_size_one_are_named_as_doing_nothing(tmp_path):
    """parallel.cp_mode=ulysses without parallel.cp trains without cp: training says so as it starts."""
    assert load_config(TINY, ["parallel.cp=2", "parallel.cp_mode=ulysses"]).parallel.inert() == ""
    assert load_config(TINY, ["parallel.cp_mode=ring", "parallel.pp_schedule=1f1b"]).parallel.inert() == ""
    idle = load_config(TINY, ["parallel.cp_zigzag=false", "parallel.pp_schedule=zb-v",
                              "parallel.sequence_parallel=false"]).parallel.inert()
    assert idle == ("parallel.sequence_parallel=false, parallel.cp_zigzag=false, parallel.pp_schedule='zb-v': no "
                    "effect with parallel.tp=1 and parallel.cp=1 and parallel.pp=1")
    with pytest.warns(UserWarning, match=r"parallel.cp_mode='ulysses': no effect with parallel.cp=1"):
        train(load_config(TINY, [f"log.run_dir={tmp_path / 'run'}", "train.steps=1", "parallel.cp_mode=ulysses"]))


def test_running_out_of_memory_in_a_step_says_what_holds_less(tmp_path):
    """A real allocation that fails (the process's address space capped at 3.5 GB; a step of 4,096 sequences asks
    for 1.5 GB of logits at once): the run stops with what to change and what was saved, not a traceback."""
    import resource
    run = tmp_path / "run"

    def capped():
        resource.setrlimit(resource.RLIMIT_AS, (3_500_000_000, 3_500_000_000))
    proc = subprocess.run([sys.executable, "-m", "sixfold.cli", "train", TINY, f"log.run_dir={run}", "train.steps=2",
                           "train.global_batch=4096", "train.seq_len=256"], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True, capture_output=True, timeout=300,
                          preexec_fn=capped)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "rank 0 ran out of memory in step 1 (4096 sequences of 256 tokens a step in 1 micro-batch(es)); hold " \
           "less at once: raise train.micro_batches" in proc.stderr
    assert "No checkpoint of this run was written." in proc.stderr


def test_a_hung_rank_ends_the_run_with_the_checkpoint_to_go_on_from(tmp_path):
    """A rank frozen mid-run (SIGSTOP): the other's collective times out, and its error says what there is to go on
    from, as for a rank that died."""
    run = tmp_path / "run"
    job = _launch(run, "parallel.timeout_s=5", "checkpoint.every=2")
    (torchrun_pid,) = children(job.pid)
    frozen = max(children(torchrun_pid))
    os.kill(frozen, signal.SIGSTOP)
    said = []
    try:
        # until the other rank's error (torchrun would wait on the frozen one before killing it)
        for line in job.stderr:
            said.append(line)
            if "sixfold error" in line:
                break
    finally:
        os.kill(frozen, signal.SIGKILL)
    err = "".join(said) + job.communicate(timeout=300)[1]
    # (the launcher reports the rank's error, or the frozen one killed here, whichever it heard of first)
    assert job.returncode in (2, 128 + signal.SIGKILL), err[-3000:]
    # (frozen in a step, or while the ranks write a checkpoint: there they wait with the heartbeat)
    assert re.search("(did not reach the same collective|another rank died or did not answer) within "
                     "parallel.timeout_s", err), err[-3000:]
    newest = max((run / "checkpoints").glob("step_*"))
    assert f"The newest checkpoint, {newest}, stays (checkpoint.resume=auto goes on from it)." in err, err[-3000:]


def test_a_log_dir_among_the_modules_arguments_is_not_torchruns(tmp_path):
    """A `--log-dir` after `-m MODULE` is the module's: torchrun still gets a directory of its own for its ranks'
    error files, removed at the end (taken for torchrun's, it left one in the temporary directory)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "sixfold.launch", "--standalone", "--nproc-per-node=1", "-m", "platform",
           f"--log-dir={tmp_path / 'mine'}"]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "sixfold_torchrun_"))]
