"""Data-parallel, ZeRO, tensor-, context-, pipeline- and expert-parallel layouts reproduce the single-process run (losses and final weights, fp32); bf16 learns."""
import pytest

from sixfold.config import load_config
from sixfold.logs import read_metrics
from sixfold.parity import LOSS_RTOL, WEIGHT_RTOL, check
from sixfold.train import train
from helpers import TINY, sixfold, torchrun

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
for tp in (2, 4):
    LAYOUTS[f"tp{tp}"] = [f"parallel.tp={tp}"]
    LAYOUTS[f"tp{tp}-no-sequence-tp"] = [f"parallel.tp={tp}", "parallel.sequence_parallel=false"]
LAYOUTS["tp2-tied"] = ["parallel.tp=2", "model.tie_embeddings=true", *ACCUM]
LAYOUTS["tp4-tied-padded-vocab"] = ["parallel.tp=4", "model.tie_embeddings=true", "model.vocab_size=322"]
LAYOUTS["tp2xdp_shard2-zero3"] = ["parallel.tp=2", "parallel.dp_shard=2", "parallel.zero=3", *ACCUM]
LAYOUTS["tp2xhsdp2x2-zero2-tied"] = ["parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=2",
                                   "parallel.zero=2", "model.tie_embeddings=true"]
for mode in ("ring", "allgather", "ulysses"):
    for cp in (2, 4):
        LAYOUTS[f"cp{cp}-{mode}"] = [f"parallel.cp={cp}", f"parallel.cp_mode={mode}"]
LAYOUTS["cp4-ring-contiguous"] = ["parallel.cp=4", "parallel.cp_zigzag=false"]
LAYOUTS["cp2xtp2-ring"] = ["parallel.cp=2", "parallel.tp=2"]
LAYOUTS["cp2xtp2-ulysses-tied"] = ["parallel.cp=2", "parallel.tp=2", "parallel.cp_mode=ulysses",
                                   "model.tie_embeddings=true"]
LAYOUTS["cp2xdp_shard2-zero3"] = ["parallel.cp=2", "parallel.dp_shard=2", "parallel.zero=3", *ACCUM]
LAYOUTS["dp_shard4-zero3-keep-gathered"] = ["parallel.dp_shard=4", "parallel.zero=3",
                                            "parallel.reshard_after_forward=false", *ACCUM]

VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "breadth-first": 2, "zb-h1": 1, "zb-v": 2}
for pp, layers, micro in ((2, 4, 4), (4, 6, 8)):
    for schedule, v in VIRTUAL.items():
        LAYOUTS[f"pp{pp}-{schedule}"] = [f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}",
                                         f"parallel.pp_virtual_stages={v}", f"model.n_layers={layers}",
                                         f"train.micro_batches={micro}"]
LAYOUTS["pp2xdp_shard2-zero1"] = ["parallel.pp=2", "parallel.dp_shard=2", "parallel.zero=1", *ACCUM]
LAYOUTS["pp2xdp_shard2-zero3-zb-h1"] = ["parallel.pp=2", "parallel.dp_shard=2", "parallel.zero=3",
                                        "parallel.pp_schedule=zb-h1", *ACCUM]
LAYOUTS["pp2xtp2"] = ["parallel.pp=2", "parallel.tp=2", *ACCUM]
LAYOUTS["pp2xcp2"] = ["parallel.pp=2", "parallel.cp=2", *ACCUM]
LAYOUTS["pp2-tied"] = ["parallel.pp=2", "model.tie_embeddings=true", *ACCUM]
LAYOUTS["pp2-interleaved-tied"] = ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2",
                                   "model.n_layers=4", "model.tie_embeddings=true", "train.micro_batches=4"]
LAYOUTS["pp2-zb-v-tied-xtp2"] = ["parallel.pp=2", "parallel.pp_schedule=zb-v", "parallel.pp_virtual_stages=2",
                                 "parallel.tp=2", "model.tie_embeddings=true", "train.micro_batches=4"]

MOE = ["model.moe_experts=4", "model.moe_top_k=2"]
LAYOUTS["ep2"] = [*MOE, "parallel.dp_shard=2", "parallel.ep=2"]
LAYOUTS["ep4"] = [*MOE, "parallel.dp_shard=4", "parallel.ep=4"]
LAYOUTS["ep2xdp_shard2-zero3"] = [*MOE, "parallel.dp_shard=2", "parallel.ep=2", "parallel.zero=3"]
LAYOUTS["ep2xdp_shard4-zero3"] = [*MOE, "parallel.dp_shard=4", "parallel.ep=2", "parallel.zero=3", *ACCUM]
LAYOUTS["ep2xhsdp2x2-zero2"] = [*MOE, "parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2",
                                "parallel.zero=2"]
LAYOUTS["ep2xtp2"] = [*MOE, "parallel.dp_shard=2", "parallel.ep=2", "parallel.tp=2"]
LAYOUTS["ep2xpp2-zb-h1"] = [*MOE, "parallel.dp_shard=2", "parallel.ep=2", "parallel.pp=2", "parallel.pp_schedule=zb-h1",
                            *ACCUM]
LAYOUTS["ep2xcp2"] = [*MOE, "parallel.cp=2", "parallel.ep=2"]
LAYOUTS["ep2-shared-every2-zero1"] = [*MOE, "model.moe_shared_expert=true", "model.moe_every=2", "parallel.dp_shard=2",
                                      "parallel.ep=2", "parallel.zero=1"]

LAYOUTS["dp_shard2-zero3-recompute-full"] = ["parallel.dp_shard=2", "parallel.zero=3", "model.recompute=full", *ACCUM]
LAYOUTS["pp2xtp2-zb-v-recompute-full"] = ["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=zb-v",
                                          "parallel.pp_virtual_stages=2", "train.micro_batches=4", "model.recompute=full"]
LAYOUTS["cp2-recompute-selective"] = ["parallel.cp=2", "model.recompute=selective"]


REFERENCES = {}  # reference runs shared by the layouts of the same model and batch


@pytest.mark.parametrize("name", LAYOUTS)
def test_parity(name, tmp_path):
    cfg = load_config(TINY, LAYOUTS[name])
    result = check(cfg, steps=4, workdir=str(tmp_path), references=REFERENCES)
    print(result.line())
    assert result.loss_rel <= LOSS_RTOL and result.weight_rel <= WEIGHT_RTOL, result.line()


def test_single_process_accumulation_matches_one_pass(tmp_path):
    cfg = load_config(TINY, ["train.micro_batches=4"])
    assert check(cfg, steps=3, workdir=str(tmp_path)).ok


@pytest.mark.parametrize("args", [["0", "fp32"], ["1", "fp32"], ["2", "fp32"], ["3", "fp32"], ["3", "fp32", "once"],
                                  ["0", "bf16"], ["1", "bf16"], ["3", "bf16"]])
def test_zero_memory_and_bytes_equal_the_formulas(args):
    proc = torchrun("zero_buffers.py", 4, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"zero {' '.join(args)} buffers OK" in proc.stdout


@pytest.mark.parametrize("layout", [["parallel.dp_shard=2", "parallel.zero=3"],
                                    ["parallel.dp_replicate=2", "train.grad_reduce=bf16"]])
def test_bf16_learns_like_fp32(tmp_path, layout):
    """50 steps in bf16 (fp32 master weights) end within 2% of the fp32 loss."""
    steps = ["train.steps=50", "train.warmup_steps=5"]
    layout = load_config(TINY, ["train.precision=bf16", *layout, *steps, f"log.run_dir={tmp_path / 'bf16'}"])
    proc = sixfold("train", str(_write(tmp_path, layout)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    train(load_config(TINY, [*steps, f"log.run_dir={tmp_path / 'fp32'}"]))
    bf16, fp32 = read_metrics(tmp_path / "bf16")[-1]["loss"], read_metrics(tmp_path / "fp32")[-1]["loss"]
    assert fp32 < read_metrics(tmp_path / "fp32")[0]["loss"] - 1.0
    assert abs(bf16 - fp32) / fp32 <= 0.02, (bf16, fp32)


def _write(tmp_path, cfg):
    path = tmp_path / "layout.yaml"
    path.write_text(cfg.to_yaml())
    return path
