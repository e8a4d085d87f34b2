"""Activation recomputation: the same gradients, fewer bytes saved for backward."""
import pytest
import torch

from sixfold.activations import SavedTensors
from sixfold.config import load_config
from sixfold.model.llama import Llama, init_weights
from helpers import TINY


def _run(recompute: str, moe: bool = False) -> tuple[int, dict]:
    cfg = load_config(TINY, [f"model.recompute={recompute}", *(["model.moe_experts=4"] if moe else [])]).model
    model = Llama(cfg)
    init_weights(model, 2)
    x = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with SavedTensors(model) as saved:
        loss = model.loss_sum(x, x)
    loss.backward()
    return saved.nbytes, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("moe", [False, True])
def test_recomputation_gives_the_same_gradients_and_saves_less(moe):
    plain, grads = _run("none", moe)
    selective, grads_selective = _run("selective", moe)
    full, grads_full = _run("full", moe)
    assert full < selective < plain
    for n, g in grads.items():
        assert torch.equal(g, grads_selective[n]) and torch.equal(g, grads_full[n]), n
