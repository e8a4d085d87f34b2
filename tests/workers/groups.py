"""Each rank builds the mesh's process groups and checks, by all-gathering ranks, who is in each."""
import sys

import torch
import torch.distributed as dist

from sixfold.config import ParallelConfig
from sixfold.mesh import GROUP_NAMES, ParallelContext

sizes = dict(arg.split("=") for arg in sys.argv[1:])
ctx = ParallelContext.initialize(ParallelConfig(**{k: int(v) for k, v in sizes.items()}))
for name in GROUP_NAMES:
    expected = ctx.dims.group_ranks(name, ctx.rank)
    if len(expected) == 1:
        assert ctx.groups[name] is None
        continue
    out = torch.zeros(len(expected), dtype=torch.int64)
    dist.all_gather_into_tensor(out, torch.tensor([ctx.rank]), group=ctx.groups[name])
    assert tuple(out.tolist()) == expected, (name, ctx.rank, out.tolist(), expected)
distinct = {id(g) for g in ctx.groups.values() if g is not None}
dist.barrier()
if ctx.rank == 0:
    print(f"groups OK: {len(distinct)} distinct groups on rank 0")
ctx.close()
