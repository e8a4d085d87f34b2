"""Under torchrun with cp ranks: context-parallel attention equals plain causal attention on the whole
sequence, forward and backward, in every mode, zigzag and contiguous, with and without GQA, and within documents
(data.document_mask); the bytes each mode sends equal its formula, in bf16 too (where the ring's gradients travel in
fp32).

    torchrun --nproc-per-node CP cp_attention.py
"""
import itertools
import os

import torch
import torch.nn.functional as F

from sixfold.comm import Comm
from sixfold.config import ParallelConfig
from sixfold.mesh import ParallelContext
from sixfold.model.documents import document_ids
from sixfold.model.visible import Visible
from sixfold.parallel.context import MODES, ContextParallel
from sixfold.trace import Tracer

size = int(os.environ["WORLD_SIZE"])
ctx = ParallelContext.initialize(ParallelConfig(cp=size))
comm = Comm(ctx, Tracer(False, ctx.rank))
g = torch.Generator().manual_seed(0)
# documents: row 0 ends one in the first chunk, a one-token one at the start of the third and two at the start of
# the last but one; row 1 is one document. Each mode reaches the CPU's chunks of queries (of 64): Ulysses' whole
# sequence, all-gather KV's local queries (under zigzag one chunk spans both of a rank's chunks of 160), the ring's
# pairs of chunks
b, s, d = 2, 320 * size, 16
chunk = s // (2 * size)
tokens = torch.ones(b, s, dtype=torch.long)
tokens[0, [3, 2 * chunk, s - 2 * chunk, s - 2 * chunk + 1]] = 0
ids = document_ids(tokens, 0)
whole = torch.arange(s)
for (hq, hkv), documents in itertools.product(((4, 4), (4, 2), (4, 1)), (False, True)):
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    seen = Visible(ids, whole, whole, torch.float64).dense() == 0 if documents else None
    out = F.scaled_dot_product_attention(*ref, attn_mask=seen, is_causal=not documents, enable_gqa=hkv != hq)
    out.backward(dout)
    for mode in MODES:
        if mode == "ulysses" and hq % size:
            continue
        for zigzag in (True, False):
            cp = ContextParallel(comm, mode, zigzag)
            mine = [cp.shard(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
            comm.ledger.total.clear()
            local = cp.attention(*mine, mask=cp.document_mask(ids, s // size, q.dtype) if documents else None)
            local.backward(cp.shard(dout, dim=2))
            what = f"{mode} zigzag={zigzag} heads {hq}/{hkv} documents={documents}"
            measured = {op: n for (group, op), n in comm.ledger.total.items() if group == "cp"}
            assert measured == cp.comm_bytes(b, hq, hkv, s // size, d, itemsize=8), (what, measured)
            assert torch.allclose(local, cp.shard(out, dim=2), rtol=1e-10, atol=1e-12), what
            for name, a, r in zip("qkv", mine, ref):
                assert torch.allclose(a.grad, cp.shard(r.grad, dim=2), rtol=1e-10, atol=1e-12), f"d{name} {what}"
for mode in MODES:
    cp = ContextParallel(comm, mode, True)
    mine = [torch.randn(b, 4, s // size, d, generator=g, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv"]
    comm.ledger.total.clear()
    cp.attention(*mine).backward(torch.ones(b, 4, s // size, d, dtype=torch.bfloat16))
    measured = {op: n for (group, op), n in comm.ledger.total.items() if group == "cp"}
    assert measured == cp.comm_bytes(b, 4, 4, s // size, d, itemsize=2), (mode, "bf16", measured)
print(f"rank {ctx.rank} cp attention OK")
ctx.close()
