"""The trainer end to end: run output, exact resume, checkpoint safety, clear errors."""
import json
import shutil

import pytest

from sixfold.logs import read_metrics
from helpers import TINY, sixfold


def _train(run_dir, *overrides, nproc=None):
    args = ["train", TINY, f"log.run_dir={run_dir}", *overrides]
    return sixfold(*args, *(["--nproc", str(nproc)] if nproc else []))


def test_run_outputs(tmp_path):
    run = tmp_path / "run"
    proc = _train(run, "train.steps=4", "train.eval_every=2", "log.tensorboard=true", "log.progress=true",
                  "log.trace=true", "log.sample_tokens=20", "parallel.dp_shard=2", "parallel.zero=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(k in metrics[0] for k in ("loss", "grad_norm", "lr", "tokens_per_s", "elapsed_s"))
    assert "val_loss" in metrics[1] and "val_loss" in metrics[3]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "config.yaml").is_file() and "dp_shard: 2" in (run / "config.yaml").read_text()
    assert "step     4 | loss" in proc.stderr + proc.stdout
    assert "sample:\ndef " in proc.stdout + proc.stderr
    trace = json.loads((run / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert any(e.get("cat") == "comm" for e in trace["traceEvents"])
    assert (run / "timeline.png").stat().st_size > 10_000
    gen = sixfold("generate", str(run), "--prompt", "import ", "--max-new-tokens", "10")
    assert gen.returncode == 0 and gen.stdout.startswith("import "), gen.stderr[-2000:]


@pytest.mark.parametrize("layout", [["parallel.dp_replicate=2"], ["parallel.dp_shard=2", "parallel.zero=3"],
                                    ["parallel.pp=2", "parallel.pp_schedule=zb-v", "parallel.pp_virtual_stages=2"],
                                    ["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero=3"]])
def test_resume_is_bit_exact(tmp_path, layout):
    """Resuming from step 3 in the same layout gives exactly the losses of the uninterrupted run."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = ["train.steps=6", "train.micro_batches=2", *layout]
    assert _train(full, *common, "checkpoint.every=3", "checkpoint.keep=5").returncode == 0
    shutil.copytree(full / "checkpoints" / "step_0000003", resumed / "checkpoints" / "step_0000003")
    (resumed / "checkpoints" / "latest").write_text("step_0000003")
    proc = _train(resumed, *common, "checkpoint.resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = read_metrics(full)[3:], read_metrics(resumed)
    assert [m["step"] for m in b] == [4, 5, 6]
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
    assert [m["grad_norm"] for m in a] == [m["grad_norm"] for m in b]


@pytest.mark.parametrize("saved,resumed,model", [
    (["parallel.dp_shard=4", "parallel.zero=3"], [], []),
    (["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero=3"], ["parallel.tp=4", "parallel.sequence_parallel=false"],
     []),
    (["parallel.pp=2", "parallel.dp_shard=2", "parallel.zero=3"],
     ["parallel.pp=4", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2", "train.micro_batches=4"],
     ["model.n_layers=6", "model.tie_embeddings=true"]),
])
def test_checkpoint_moves_across_layouts(tmp_path, saved, resumed, model):
    """Saved in one layout, resumed in another: the rest matches the uninterrupted single-process run."""
    sharded, moved, reference = tmp_path / "sharded", tmp_path / "moved", tmp_path / "reference"
    common = ["train.steps=6", *model]
    assert _train(sharded, *common, *saved, "checkpoint.every=3").returncode == 0
    proc = _train(moved, *common, *resumed, f"checkpoint.resume={sharded / 'checkpoints' / 'step_0000003'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _train(reference, *common).returncode == 0
    for a, b in zip(read_metrics(moved), read_metrics(reference)[3:]):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"]


def test_bad_checkpoints(tmp_path):
    run = tmp_path / "run"
    assert _train(run, "train.steps=2").returncode == 0
    ckpt = run / "checkpoints" / "step_0000002"
    mismatch = _train(tmp_path / "b", "train.steps=3", "model.dim=128", "model.ffn_dim=352",
                      f"checkpoint.resume={ckpt}")
    assert mismatch.returncode == 2 and "embed.weight has shape (320, 64), the model expects (320, 128)" in mismatch.stderr
    fresh = _train(tmp_path / "fresh", "train.steps=1", "checkpoint.resume=auto")
    assert fresh.returncode == 0 and len(read_metrics(tmp_path / "fresh")) == 1
    missing = _train(tmp_path / "c", f"checkpoint.resume={tmp_path / 'nowhere'}")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    corrupt = tmp_path / "corrupt"
    shutil.copytree(ckpt, corrupt)
    data = bytearray((corrupt / "model.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (corrupt / "model.safetensors").write_bytes(bytes(data))
    bad = _train(tmp_path / "d", "train.steps=3", f"checkpoint.resume={corrupt}")
    assert bad.returncode == 2 and "model.safetensors is corrupt" in bad.stderr


def test_nan_loss_stops_with_a_clear_error(tmp_path):
    proc = _train(tmp_path / "run", "train.lr=1e30", "train.grad_clip=0", "train.warmup_steps=0",
                  "train.steps=6", "checkpoint.save_final=false")
    assert proc.returncode == 2
    assert "weights were not updated" in proc.stderr and "train.lr" in proc.stderr


def test_layout_errors_before_any_process_starts(tmp_path):
    proc = _train(tmp_path / "run", "parallel.dp_replicate=2", nproc=3)
    assert proc.returncode == 2 and "world size 3 does not equal" in proc.stderr
    proc = _train(tmp_path / "run", "parallel.pp=8")
    assert proc.returncode == 2 and "model.n_layers to at least 6" in proc.stderr
    proc = sixfold("check", TINY, "train.precision=bf16")
    assert proc.returncode == 2 and "set train.precision=fp32" in proc.stderr
    proc = _train(tmp_path / "run", "parallel.dp_shrd=2")
    assert proc.returncode == 2 and "did you mean 'dp_shard'" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _train(tmp_path / "run", f"data.source={empty}")
    assert proc.returncode == 2 and "data" in proc.stderr


def test_check_command_prints_one_verdict(tmp_path):
    proc = sixfold("check", TINY, "parallel.dp_replicate=2", "--steps", "2", "--workdir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("parity OK: dp_replicate2, 2 steps")
