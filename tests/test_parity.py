"""Data-parallel layouts reproduce the single-process run (losses and final weights, fp32)."""
import pytest

from sixfold.config import load_config
from sixfold.parity import LOSS_RTOL, WEIGHT_RTOL, check
from helpers import TINY

LAYOUTS = {
    "dp2": ["parallel.dp_replicate=2"],
    "dp4": ["parallel.dp_shard=4"],
    "dp2-accum": ["parallel.dp_replicate=2", "train.micro_batches=2"],
    "dp4-accum-buckets": ["parallel.dp_shard=4", "train.micro_batches=2", "parallel.bucket_mb=0.05"],
    "dp2x2-tied": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "model.tie_embeddings=true"],
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_parity(name, tmp_path):
    cfg = load_config(TINY, LAYOUTS[name])
    result = check(cfg, steps=4, workdir=str(tmp_path))
    print(result.line())
    assert result.loss_rel <= LOSS_RTOL and result.weight_rel <= WEIGHT_RTOL, result.line()


def test_single_process_accumulation_matches_one_pass(tmp_path):
    cfg = load_config(TINY, ["train.micro_batches=4"])
    assert check(cfg, steps=3, workdir=str(tmp_path)).ok
