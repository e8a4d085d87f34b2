"""Under torchrun with ep ranks: the all-to-all bytes of one forward and backward, summed over the ep group,
equal tokens * k * hidden * bytes per MoE layer for each of dispatch and combine, forward and backward (plus
the exchanged expert counts), and the expert outputs equal one process's. An MoE layer's forward, with ep ranks
or without, waits for the device once: for its expert counts, which size the all-to-all and the experts' products.
Routed to the same experts, every token leaves some ep ranks without rows: outputs as before, their experts' gradients
zero.

    torchrun --nproc-per-node EP expert_bytes.py
"""
import os
from contextlib import contextmanager

import torch

from sixfold.comm import Comm
from sixfold.config import ParallelConfig, load_config
from sixfold.mesh import ParallelContext
from sixfold.model.llama import Llama, init_weights
from sixfold.parallel.expert import ExpertParallel
from sixfold.parallel.tensor import TensorParallel
from sixfold.trace import Tracer

ep = int(os.environ["WORLD_SIZE"])
cfg = load_config("configs/tiny.yaml", ["model.moe_experts=4", "model.moe_top_k=2"]).model
ctx = ParallelContext.initialize(ParallelConfig(dp_shard=ep, ep=ep))
comm = Comm(ctx, Tracer(False, ctx.rank))
model = Llama(cfg, TensorParallel(comm), ep=ExpertParallel(comm))
init_weights(model, 4)
x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(ctx.rank))
model.loss_sum(x, x).backward()

rows = 2 * 16 * cfg.moe_top_k * cfg.n_layers  # this rank's routed rows over all MoE layers
sent = torch.tensor([comm.ledger.total["ep", "all_to_all"], rows], dtype=torch.float64)
torch.distributed.all_reduce(sent)
counts = ep * cfg.n_layers * cfg.moe_experts * 8  # int64 rows per expert, exchanged before each dispatch
assert sent[0] == 4 * sent[1] * cfg.dim * 4 + counts, (sent.tolist(), counts)

whole = Llama(cfg)
init_weights(whole, 4)
with torch.no_grad():
    assert torch.allclose(model(x), whole(x), atol=1e-5)


@contextmanager
def device_reads():
    """The reads of a tensor's values by the host made inside (torch.bincount's too: on a GPU it reads its input's
    largest value to size its output)."""
    reads = []
    patched = {(torch.Tensor, n): getattr(torch.Tensor, n)
               for n in ("tolist", "item", "__float__", "__int__", "__bool__", "__index__")}
    patched[torch, "bincount"] = torch.bincount
    for (owner, name), f in patched.items():
        setattr(owner, name, lambda *a, _f=f, _n=name, **k: reads.append(_n) or _f(*a, **k))
    try:
        yield reads
    finally:
        for (owner, name), f in patched.items():
            setattr(owner, name, f)


h = torch.randn(32, cfg.dim, generator=torch.Generator().manual_seed(ctx.rank))
for layers in (model.layers, whole.layers):
    with device_reads() as reads:
        layers["0"].mlp(h, False)
    assert len(reads) == 1, reads

# routers at zero: every token ties on the same k experts, so the ep ranks of the others receive no rows; outputs
# still equal one process's, and the experts that had no rows get a gradient of zero
for m in (model, whole):
    with torch.no_grad():
        for block in m.layers.values():
            block.mlp.router.weight.zero_()
    m.zero_grad()
    m.loss_sum(x, x).backward()
with torch.no_grad():
    assert torch.allclose(model(x), whole(x), atol=1e-5)
local = cfg.moe_experts // ep
for mine, one in zip(model.layers.values(), whole.layers.values()):
    idle = one.mlp.experts.w_up.grad.flatten(1).abs().amax(1) == 0
    assert idle.view(ep, local).all(1).any() and not idle.all()  # a whole ep rank without rows, not every one
    got = mine.mlp.experts.w_up.grad.flatten(1).abs().amax(1) == 0
    assert torch.equal(got, idle[ctx.rank * local:(ctx.rank + 1) * local]), (got, idle)
print(f"rank {ctx.rank} expert bytes OK", flush=True)
ctx.close()
