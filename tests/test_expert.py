"""Expert parallelism's pieces: dispatch bytes and outputs against one process; the router's weights. Whole-run
parity is in test_parity.py, Mixtral interop in test_hf.py, bad layouts in test_config.py."""
import pytest
import torch

from sixfold.config import ConfigError, load_config
from sixfold.model.hf import hf_config_from_model
from sixfold.model.llama import Llama, init_weights
from sixfold.model.moe import routing_warning
from helpers import TINY, torchrun


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_bytes_equal_the_formula_and_outputs_one_process(ep):
    proc = torchrun("expert_bytes.py", ep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("expert bytes OK") == ep


def _router_grad(norm_topk: bool) -> float:
    """The largest router gradient of a top-1 model from the language-model loss alone."""
    cfg = load_config(TINY, ["model.moe_experts=4", "model.moe_top_k=1", f"model.moe_norm_topk={norm_topk}",
                             "model.moe_aux_weight=0", "model.moe_z_weight=0"], check=False).model
    model = Llama(cfg)
    init_weights(model, 0)
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    model.loss_sum(x, x).backward()
    return max(float(p.grad.abs().max()) for n, p in model.named_parameters() if "router" in n)


def test_top1_router_learns_from_the_loss_only_with_switch_weights():
    switch = _router_grad(norm_topk=False)
    assert switch > 1e-3
    assert _router_grad(norm_topk=True) < 1e-5 * switch  # a renormalised single weight is 1: round-off only
    top1 = load_config(TINY, ["model.moe_experts=4", "model.moe_top_k=1"]).model
    assert "set model.moe_norm_topk=false" in routing_warning(top1)  # shown by rank 0 as training starts
    assert not routing_warning(load_config(TINY, ["model.moe_experts=4", "model.moe_top_k=1",
                                                  "model.moe_norm_topk=false"]).model)
    cfg = load_config(TINY, ["model.moe_experts=4", "model.moe_norm_topk=false"]).model
    with pytest.raises(ConfigError, match="Mixtral renormalises"):
        hf_config_from_model(cfg)
