"""Under torchrun with cp ranks: the bytes each rank saves for backward in one forward of the tiny model, in
every cp mode, and those of the whole sequence in one process (written as JSON for the test).

    torchrun --nproc-per-node CP cp_memory.py OUT.json
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from sixfold.activations import SavedTensors
from sixfold.comm import Comm
from sixfold.config import ParallelConfig, load_config
from sixfold.mesh import ParallelContext
from sixfold.model.llama import Llama
from sixfold.parallel.context import MODES, ContextParallel
from sixfold.parallel.tensor import TensorParallel
from sixfold.trace import Tracer

cfg = load_config("configs/tiny.yaml").model
ctx = ParallelContext.initialize(ParallelConfig(cp=int(os.environ["WORLD_SIZE"])))
comm = Comm(ctx, Tracer(False, ctx.rank))
x = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))


def saved(cp: ContextParallel) -> int:
    model = Llama(cfg, TensorParallel(), cp)
    with SavedTensors(model) as s:
        loss = model.loss_sum(cp.shard(x), cp.shard(x))
    loss.backward()
    return s.nbytes


result = {"whole": saved(ContextParallel())}
for mode in MODES:
    per_rank = [None] * ctx.world_size
    dist.all_gather_object(per_rank, saved(ContextParallel(comm, mode)))
    result[mode] = per_rank
if ctx.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
ctx.close()
