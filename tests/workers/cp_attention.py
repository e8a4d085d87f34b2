"""Under torchrun with cp ranks: context-parallel attention equals plain causal attention on the whole
sequence, forward and backward, in every mode, zigzag and contiguous, with and without GQA; the bytes each
mode sends equal its formula.

    torchrun --nproc-per-node CP cp_attention.py
"""
import os

import torch
import torch.nn.functional as F

from sixfold.comm import Comm
from sixfold.config import ParallelConfig
from sixfold.mesh import ParallelContext
from sixfold.parallel.context import MODES, ContextParallel
from sixfold.trace import Tracer

size = int(os.environ["WORLD_SIZE"])
ctx = ParallelContext.initialize(ParallelConfig(cp=size))
comm = Comm(ctx, Tracer(False, ctx.rank))
g = torch.Generator().manual_seed(0)
for hq, hkv in ((4, 4), (4, 2), (4, 1)):
    b, s, d = 2, 8 * size, 16
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=hkv != hq)
    out.backward(dout)
    for mode in MODES:
        if mode == "ulysses" and hq % size:
            continue
        for zigzag in (True, False):
            cp = ContextParallel(comm, mode, zigzag)
            mine = [cp.shard(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
            comm.ledger.total.clear()
            local = cp.attention(*mine)
            local.backward(cp.shard(dout, dim=2))
            what = f"{mode} zigzag={zigzag} heads {hq}/{hkv}"
            measured = {op: n for (group, op), n in comm.ledger.total.items() if group == "cp"}
            assert measured == cp.comm_bytes(b, hq, hkv, s // size, d, itemsize=8), (what, measured)
            assert torch.allclose(local, cp.shard(out, dim=2), rtol=1e-10, atol=1e-12), what
            for name, a, r in zip("qkv", mine, ref):
                assert torch.allclose(a.grad, cp.shard(r.grad, dim=2), rtol=1e-10, atol=1e-12), f"d{name} {what}"
print(f"rank {ctx.rank} cp attention OK")
ctx.close()
