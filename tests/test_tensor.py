"""Tensor parallelism's pieces: splits of full tensors, the collectives' bytes, deferred weight gradients,
activation memory under sequence-TP. Parity of whole runs is in test_parity.py."""
import json
import weakref
from pathlib import Path

import pytest
import torch

from sixfold.config import load_config
from sixfold.model.llama import Llama, init_weights
from sixfold.parallel.tensor import TensorParallel, _stacked, cross_entropy, linear
from sixfold.slices import Cut
from helpers import TINY, torchrun


class FakeRank(TensorParallel):
    """The split arithmetic of a tp rank, without a process group."""

    def __init__(self, size: int, rank: int, sequence: bool = False):
        super().__init__()
        self.size, self.rank, self.sequence = size, rank, sequence


@pytest.mark.parametrize("full,parts,tp", [(320, 4, 4), (322, 4, 4), (2, 2, 4), (4, 4, 4), (8, 1, 2)])
def test_pieces_cover_the_full_tensor_where_their_cuts_place_them(full, parts, tp):
    t = torch.randn(full, 6)
    splits = [FakeRank(tp, r).split(0, full, parts, pad=True) for r in range(tp)]
    pieces = [s.local(t) for s in splits]
    assert all(p.shape == pieces[0].shape for p in pieces)  # equal pieces: gathers need no sizes
    assert splits[0].full_shape(pieces[0].shape) == t.shape
    seen = torch.zeros(t.numel(), dtype=torch.bool)
    for split, piece in zip(splits, pieces):
        at = Cut.of(split).positions(tuple(t.shape))  # where checkpoints put each element of the piece
        assert torch.equal(piece.flatten()[at < 0], torch.zeros(int((at < 0).sum())))
        assert torch.equal(piece.flatten()[at >= 0], t.flatten()[at[at >= 0]])
        seen[at[at >= 0]] = True
    assert seen.all()


def test_padded_vocab_rows_are_zero_and_replicated_pieces_repeat():
    t = torch.randn(322, 3)
    last = FakeRank(4, 3).split(0, 322, pad=True)
    assert last.size == 81 and torch.equal(last.local(t)[-2:], torch.zeros(2, 3))
    kv = [FakeRank(4, r).split(0, 2, parts=2, partial_grad=True) for r in range(4)]
    assert [s.index for s in kv] == [0, 0, 1, 1] and all(s.partial_grad for s in kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_at_tp_1_is_torchs_cross_entropy(dtype):
    """The loss made in place (4 bytes a logit in its backward, where F.cross_entropy holds 12) gives its values
    and gradients, masked labels left out, to fp32 round-off."""
    torch.manual_seed(0)
    logits = (torch.randn(200, 321) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 321, (200,))
    labels[::7] = -100
    ours = cross_entropy(FakeRank(1, 0), logits, labels, 0, 321)
    ours.backward()
    ours = ours.detach()
    grad, logits.grad = logits.grad, None
    theirs = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
    theirs.backward()
    theirs = theirs.detach()
    assert abs(ours.item() - theirs.item()) <= 1e-6 * theirs.item() and grad.dtype == dtype
    assert (grad.float() - logits.grad.float()).norm() <= 1e-6 * logits.grad.float().norm()


def test_deferred_weight_gradients_equal_immediate_ones_in_one_process():
    model = Llama(load_config(TINY).model)
    init_weights(model, 1)
    x = torch.randint(0, 300, (2, 16))
    model.loss_sum(x, x).backward()
    immediate = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.tp.weight_grads.defer = True
    model.loss_sum(x, x).backward()
    assert model.layers["0"].attn.wq.weight.grad is None and model.norm.weight.grad is not None
    model.tp.weight_grads.run()
    for n, p in model.named_parameters():
        # autograd's own linear against ours: equal to round-off
        assert (p.grad - immediate[n]).norm() <= 1e-6 * immediate[n].norm(), n


def test_running_deferred_weight_gradients_drops_each_item_before_the_next():
    model = Llama(load_config(TINY).model)
    init_weights(model, 1)
    wg = model.tp.weight_grads
    wg.defer = True
    model.loss_sum(*[torch.randint(0, 300, (2, 16))] * 2).backward()
    wg.defer = False
    work = wg.take()
    held = [{id(c.cell_contents): c.cell_contents for c in compute.__closure__
             if isinstance(c.cell_contents, torch.Tensor)} for _, compute in work]
    # what an item alone holds (the output gradient and input it needs), by weak reference
    alone = [[weakref.ref(t) for i, t in mine.items() if not any(i in other for other in held[k + 1:])]
             for k, mine in enumerate(held)]
    owner = {id(w): k for k, (weights, _) in enumerate(work) for w in weights}
    del held
    alive = []
    wg.on_grad = lambda w: alive.append(sum(r() is not None for refs in alone[:owner[id(w)]] for r in refs))
    wg.run(work)
    assert work == [] and len(alive) == len(owner) and max(alive) == 0
    assert sum(len(refs) for refs in alone) > len(alone) and all(r() is None for refs in alone for r in refs)


def test_weights_lying_one_after_another_are_stacked_as_a_view_not_copied():
    flat = torch.randn(2 * 24 + 16)
    a, b, c = flat[:24].view(3, 8), flat[24:48].view(3, 8), flat[48:].view(2, 8)
    x = torch.randn(5, 8)
    assert _stacked((a, b, c), False).data_ptr() == flat.data_ptr()
    assert _stacked((b, a), False).data_ptr() not in (a.data_ptr(), b.data_ptr())  # out of order: a copy
    turned = flat[24:56].view(8, 4).t()  # right after a, but not contiguous: a copy
    copy = _stacked((a, turned), False)
    assert torch.equal(copy, torch.cat([a, turned])) and copy.data_ptr() != a.data_ptr()
    row = flat[:8].view(8, 1).t()  # one row, contiguous whatever its stride says
    assert torch.equal(_stacked((row, flat[8:16].view(1, 8)), False), flat[:16].view(2, 8))
    results = []
    for weights in [(a, b, c), (a.clone(), b.clone(), c.clone())]:
        for w in weights:
            w.requires_grad_(True)
        y = linear(TensorParallel(), x.requires_grad_(True), list(weights), "column", False)
        y.square().sum().backward()
        results.append([y.detach(), x.grad.clone()] + [w.grad for w in weights])
        x.grad = None
    for view, copy in zip(*results):
        assert torch.equal(view, copy)


def _layers(tp: int, sequence: bool, out: Path) -> dict:
    proc = torchrun("tp_layers.py", tp, "1" if sequence else "0", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("tp layers OK") == tp
    return json.loads(out.read_text())


@pytest.mark.parametrize("tp", [2, 4])
def test_bytes_equal_the_formula_and_sequence_tp_splits_saved_activations(tp, tmp_path):
    """The worker asserts the ledger's tp bytes and deferred gradients; here, the saved activations."""
    plain, sequence = _layers(tp, False, tmp_path / "plain.json"), _layers(tp, True, tmp_path / "sequence.json")
    assert sequence["sequence_split"] * tp == plain["sequence_split"]
    assert sequence["total"] - sequence["sequence_split"] == plain["total"] - plain["sequence_split"]
