"""Rank 2 never joins the collectives of ranks 0 and 1: each must stop after parallel.timeout_s with an error
naming its group (an object collective too: a checkpoint's save gathers its index so) and rank 2, with its machine
and process id, as the rank to look at (not each other: both failed alike). Then rank 1 runs another collective
than rank 0's, and rank 0's error names rank 1's.

    torchrun --nproc-per-node 3 hang.py
"""
import os
import sys
import time

import torch

from sixfold.comm import Comm
from sixfold.config import ParallelConfig
from sixfold.errors import CommError
from sixfold.mesh import ParallelContext
from sixfold.trace import Tracer

ctx = ParallelContext.initialize(ParallelConfig(dp_replicate=3, timeout_s=3))
comm = Comm(ctx, Tracer(False, ctx.rank))


def say(line: str) -> None:
    """The line and its newline in one write: the ranks share stdout, where print's two writes (unbuffered, as under
    PYTHONUNBUFFERED=1) can come out between another rank's."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


say(f"rank {ctx.rank} pid {os.getpid()}")
if ctx.rank < 2:
    for collective in (lambda: comm.gather_objects({"index": 1}, "dp_replicate"),
                       lambda: comm.all_reduce(torch.ones(4), "dp_replicate", label="grads"),
                       lambda: comm.all_reduce(torch.ones(4), "dp_replicate", label="loss") if ctx.rank == 0
                       else comm.broadcast(torch.ones(4), "dp_replicate", 0)):
        try:
            collective()
        except CommError as e:
            say(f"rank {ctx.rank} stopped: {e}")
else:
    time.sleep(25)
