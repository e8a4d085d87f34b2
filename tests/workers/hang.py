"""Rank 1 never joins rank 0's all-reduce: rank 0 must stop after parallel.timeout_s with an error naming the group.

    torchrun --nproc-per-node 2 hang.py
"""
import time

import torch

from sixfold.comm import Comm, CommError
from sixfold.config import ParallelConfig
from sixfold.mesh import ParallelContext
from sixfold.trace import Tracer

ctx = ParallelContext.initialize(ParallelConfig(dp_replicate=2, timeout_s=3))
comm = Comm(ctx, Tracer(False, ctx.rank))
if ctx.rank == 0:
    try:
        comm.all_reduce(torch.ones(4), "dp_replicate", label="grads")
    except CommError as e:
        print(f"rank 0 stopped: {e}", flush=True)
else:
    time.sleep(15)
