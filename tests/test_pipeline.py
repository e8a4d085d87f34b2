"""Pipeline stages and runtime: the split of layers by cost, the runtime against one process and the simulator,
bad settings. Schedules alone are in test_schedules.py; whole-run parity in test_parity.py."""
import pytest

from sixfold.config import ConfigError, ModelConfig, load_config
from sixfold.parallel.pipeline.stages import layer_costs, split_stages
from helpers import TINY, torchrun


@pytest.mark.parametrize("layers,n", [(2, 2), (2, 4), (6, 8), (8, 2), (8, 3), (32, 8)])
def test_stages_cover_the_model_in_order_and_are_balanced(layers, n):
    cfg = ModelConfig(n_layers=layers)
    stages = split_stages(cfg, n, 64)
    assert [s.index for s in stages] == list(range(n))
    assert stages[0].embed and stages[-1].head and not any(s.embed for s in stages[1:])
    assert [i for s in stages for i in s.layers] == list(range(layers))
    costs = layer_costs(cfg, 64)
    loads = [costs[0] * s.embed + sum(costs[1 + i] for i in s.layers) + costs[-1] * s.head for s in stages]
    # no single piece can move to a neighbour and lower the largest load
    assert max(loads) <= sum(costs) / n + max(costs)


def test_the_head_counts_in_the_split():
    cfg = ModelConfig(n_layers=8, dim=64, vocab_size=32000)  # a head heavier than several blocks
    first, second = split_stages(cfg, 2, 64)
    assert len(first.layers) > len(second.layers)


def test_an_moe_block_costs_its_routed_experts():
    """A token visits top_k experts and the router: the stages are balanced by that."""
    dense, moe = ModelConfig(n_layers=4), ModelConfig(n_layers=4, moe_experts=8, moe_top_k=2, moe_every=2)
    extra = 2 * 3 * dense.dim * dense.ffn_dim + 2 * dense.dim * 8  # a second expert and the router
    more = [b - a for a, b in zip(layer_costs(dense, 64), layer_costs(moe, 64))]
    assert more == [0, extra, 0, extra, 0, 0]  # blocks 0 and 2 (after the embedding)


def test_too_many_stages_is_refused_naming_the_settings():
    with pytest.raises(ConfigError, match="model.n_layers to at least 6"):
        load_config(TINY, ["parallel.pp=4", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2",
                           "train.micro_batches=4"])


@pytest.mark.parametrize("overrides,message", [
    (["parallel.pp=2", "parallel.pp_schedule=zigzag"], "not one of"),
    (["parallel.pp_schedule=zigzag"], "not one of"),  # without pipelining too
    (["parallel.pp_virtual_stages=0"], "pp_virtual_stages=0 must be at least 1"),
    (["parallel.pp_schedule=zb-v", "parallel.pp_virtual_stages=2"], "parallel.pp=1 runs no pipeline: set "
                                                                     "parallel.pp_virtual_stages=1"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2",
      "train.micro_batches=1", "model.n_layers=4"], "multiple of parallel.pp=2: set train.micro_batches to 2 or 4 "
                                                     "or 8,"),  # those that divide the 8 sequences
    (["parallel.pp=3", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2",
      "train.micro_batches=2", "model.n_layers=4"], "no multiple of 3 divides the 8 sequence\\(s\\) per data-parallel "
                                                     "rank \\(train.global_batch / dp\\): change train.global_batch"),
    (["parallel.pp=2", "parallel.pp_schedule=zb-v"], "pp_virtual_stages=2"),
    (["parallel.pp=3", "parallel.pp_schedule=zb-v", "parallel.pp_virtual_stages=2"],
     r"=6 stages, but the model has only 4 pieces .*: lower parallel.pp, or raise model.n_layers to at least 4"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2", "model.n_layers=4",
      "train.micro_batches=4", "parallel.dp_replicate=2", "train.global_batch=4"],
     r"set train.global_batch to a multiple of 8 \(such as 8\), or train.micro_batches to one of 2$"),
    (["parallel.pp=2", "parallel.dp_shard=2", "parallel.zero=3", "parallel.reshard_after_forward=true"],
     "once per step"),
])
def test_bad_pipeline_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)


# zb-v filled greedily at (2, 1) (no interleaved) and (2, 2)
@pytest.mark.parametrize("pp,micro", [(2, 4), (4, 8), (2, 1), (2, 2)])
def test_runtime_gradients_in_flight_and_bytes(pp, micro):
    proc = torchrun("pipeline_runtime.py", pp, str(micro))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(" OK") == (10 if micro % pp else 12) * pp


def test_a_stage_that_raises_stops_the_others_with_its_error(tmp_path):
    """Rank 1's stage raises in step 2 (an operation train.deterministic refuses) and stays in the job: rank 0
    stops at the step's end with rank 1's error, not after parallel.timeout_s for its messages."""
    proc = torchrun("stage_fails.py", 2, TINY, str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    refused = "train.deterministic=true, and put_ has no deterministic kernel"
    for schedule in ("1f1b", "zb-v"):
        assert f"{schedule} rank 1: TrainingError: {refused}" in proc.stdout, proc.stdout
        said = f"{schedule} rank 0: PeerStopped: rank 1 (pipeline stage 1) failed in step 2: {refused}"
        assert said in proc.stdout, proc.stdout
