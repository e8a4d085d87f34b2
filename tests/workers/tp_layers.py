"""Under torchrun with tp ranks: the tp collectives' bytes equal the formula, deferred weight gradients equal
immediate ones, the vocab-parallel loss equals cross-entropy over the whole vocabulary, generation's last-token
logits through a KV cache equal one process's, and the saved activations (written as JSON for the test to compare
across runs).

    torchrun --nproc-per-node TP tp_layers.py SEQUENCE(0|1) OUT.json
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

from sixfold.activations import SavedTensors
from sixfold.comm import Comm
from sixfold.config import ParallelConfig, load_config
from sixfold.mesh import ParallelContext
from sixfold.model.llama import KVCache, Llama, init_weights
from sixfold.parallel.tensor import IGNORE_INDEX, TensorParallel, comm_bytes, cross_entropy
from sixfold.trace import Tracer

sequence = sys.argv[1] == "1"
cfg = load_config("configs/tiny.yaml").model
ctx = ParallelContext.initialize(ParallelConfig(tp=int(os.environ["WORLD_SIZE"]),
                                                sequence_parallel=sequence))
tp_size = ctx.size("tp")
comm = Comm(ctx, Tracer(False, ctx.rank))
model = Llama(cfg, TensorParallel(comm, sequence))
init_weights(model, 7)
g = torch.Generator().manual_seed(3)
batch, seq = 2, 32
x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)

with SavedTensors(model) as saved:
    loss = model.loss_sum(x, y)
loss.backward()
measured = {op: b for (group, op), b in comm.ledger.total.items() if group == "tp"}
expected = comm_bytes(cfg.n_layers, batch * seq, cfg.dim, tp_size, sequence)
assert measured == expected, (measured, expected)

immediate = {n: p.grad.clone() for n, p in model.named_parameters()}
model.zero_grad(set_to_none=True)
model.tp.weight_grads.defer = True
model.loss_sum(x, y).backward()
deferred_now = [n for n, p in model.named_parameters() if p.grad is None]
model.tp.weight_grads.run()
assert len(deferred_now) == 7 * cfg.n_layers, deferred_now  # every linear weight but the head's (logits-sized dy)
for n, p in model.named_parameters():
    assert torch.equal(p.grad, immediate[n]), n

# vocabularies padded to a multiple of tp, small enough that at tp 4 the last piece begins past the end (5: rows 6, 7)
for vocab in (tp_size + 1, 2 * tp_size - 1, cfg.vocab_size):
    full = torch.randn(9, vocab, generator=g)
    labels = torch.randint(0, vocab, (9,), generator=g).index_fill(0, torch.tensor([2, 5]), IGNORE_INDEX)
    split = model.tp.split(0, vocab, pad=True)
    piece = split.local(full.t()).t().clone().requires_grad_()
    cross_entropy(model.tp, piece, labels, split.index * split.size, vocab).backward()
    whole = full.clone().requires_grad_()
    expected = F.cross_entropy(whole, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    expected.backward()
    assert torch.allclose(piece.grad, split.local(whole.grad.t()).t(), rtol=0, atol=1e-6), (vocab, piece.grad)
    total = cross_entropy(model.tp, piece.detach(), labels, split.index * split.size, vocab)
    assert abs(float(total - expected)) <= 1e-6 * float(expected), (vocab, float(total), float(expected))

# generation: each token's logits through the KV cache (the prompt's 8 under sequence-TP) equal one process's
reference = Llama(cfg)
init_weights(reference, 7)
prompt = torch.randint(0, cfg.vocab_size, (1, 12), generator=g)
cache, alone = KVCache(cfg.n_layers, 12), KVCache(cfg.n_layers, 12)
with torch.no_grad():
    for a, b in ((0, 8), (8, 9), (9, 10), (10, 11), (11, 12)):
        got, want = model(prompt[:, a:b], cache, last=True), reference(prompt[:, a:b], alone, last=True)
        assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-6), (b, got - want)

tokens_here = batch * seq // tp_size if sequence else batch * seq
split = saved.token_rows_nbytes(tokens_here, cfg.dim)
if ctx.rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump({"sequence_split": split, "total": saved.nbytes}, f)
print(f"rank {ctx.rank} tp layers OK")
ctx.close()
