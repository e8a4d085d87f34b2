"""Rank 1 never joins rank 0's collectives: each must stop after parallel.timeout_s with an error naming its group
(an object collective too: a checkpoint's save gathers its index so).

    torchrun --nproc-per-node 2 hang.py
"""
import time

import torch

from sixfold.comm import Comm
from sixfold.config import ParallelConfig
from sixfold.errors import CommError
from sixfold.mesh import ParallelContext
from sixfold.trace import Tracer

ctx = ParallelContext.initialize(ParallelConfig(dp_replicate=2, timeout_s=3))
comm = Comm(ctx, Tracer(False, ctx.rank))
if ctx.rank == 0:
    for collective in (lambda: comm.gather_objects({"index": 1}, "dp_replicate"),
                       lambda: comm.all_reduce(torch.ones(4), "dp_replicate", label="grads")):
        try:
            collective()
        except CommError as e:
            print(f"rank 0 stopped: {e}", flush=True)
else:
    time.sleep(15)
