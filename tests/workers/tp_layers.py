"""Under torchrun with tp ranks: the tp collectives' bytes equal the formula, deferred weight gradients equal
immediate ones, and the saved activations (written as JSON for the test to compare across runs).

    torchrun --nproc-per-node TP tp_layers.py SEQUENCE(0|1) OUT.json
"""
import json
import os
import sys

import torch

from sixfold.activations import SavedTensors
from sixfold.comm import Comm
from sixfold.config import ParallelConfig, load_config
from sixfold.mesh import ParallelContext
from sixfold.model.llama import Llama, init_weights
from sixfold.parallel.tensor import TensorParallel, comm_bytes
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

tokens_here = batch * seq // tp_size if sequence else batch * seq
split = saved.token_rows_nbytes(tokens_here, cfg.dim)
if ctx.rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump({"sequence_split": split, "total": saved.nbytes}, f)
print(f"rank {ctx.rank} tp layers OK")
ctx.close()
