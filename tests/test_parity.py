"""Data-parallel layouts reproduce the single-process run (losses and final weights, fp32)."""
import pytest

from sixfold.config import load_config
from sixfold.parity import LOSS_RTOL, WEIGHT_RTOL, check
from helpers import TINY

LAYOUTS = {
    "dp2": ["parallel.dp_replicate=2"],
    "dp4": ["parallel.dp_shard=4"],
    "dp2-accum": ["parallel.dp_replicate=2", "train.micro_batches=2"],
    "dp4-accum": ["parallel.dp_shard=4", "train.micro_batches=2"],
    "dp2x2-tied": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "model.tie_embeddings=true"],
}
ACCUM = ["train.micro_batches=2"]
for shards in (2, 4):
    for zero in (1, 2, 3):
        LAYOUTS[f"dp_shard{shards}-zero{zero}"] = [f"parallel.dp_shard={shards}", f"parallel.zero={zero}", *ACCUM]
LAYOUTS["hsdp2x2-zero3"] = ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero=3", *ACCUM]
LAYOUTS["hsdp2x2-zero2-tied"] = ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero=2",
                                 "model.tie_embeddings=true", *ACCUM]
LAYOUTS["dp_shard4-zero3-keep-gathered"] = ["parallel.dp_shard=4", "parallel.zero=3",
                                            "parallel.reshard_after_forward=false", *ACCUM]


@pytest.mark.parametrize("name", LAYOUTS)
def test_parity(name, tmp_path):
    cfg = load_config(TINY, LAYOUTS[name])
    result = check(cfg, steps=4, workdir=str(tmp_path))
    print(result.line())
    assert result.loss_rel <= LOSS_RTOL and result.weight_rel <= WEIGHT_RTOL, result.line()


def test_single_process_accumulation_matches_one_pass(tmp_path):
    cfg = load_config(TINY, ["train.micro_batches=4"])
    assert check(cfg, steps=3, workdir=str(tmp_path)).ok


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_frees_buffers_and_counts_its_bytes(zero):
    from helpers import torchrun
    proc = torchrun("zero_buffers.py", 4, str(zero))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"zero {zero} buffers OK" in proc.stdout
