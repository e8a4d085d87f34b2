"""Rank 2 never joins the collectives of ranks 0 and 1: each must stop after parallel.timeout_s with an error
naming its group (an object collective too: a checkpoint's save gathers its index so) and rank 2, with its machine
and process id, as the rank to look at (not each other: both failed alike). Then rank 1 runs another collective
than rank 0's, and rank 0's error names rank 1's. Rank 2 ends once both are done.

    torchrun --nproc-per-node 3 hang.py
"""
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from sixfold.comm import Comm
from sixfold.config import ParallelConfig
from sixfold.errors import CommError
from sixfold.mesh import ParallelContext
from sixfold.trace import Tracer

ctx = ParallelContext.initialize(ParallelConfig(dp_replicate=3, timeout_s=3))
comm = Comm(ctx, Tracer(False, ctx.rank))
DONE = Path(tempfile.gettempdir()) / f"sixfold-hang-{os.getppid()}"  # the ranks' torchrun agent: theirs alone
DONE.mkdir(exist_ok=True)


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
    (DONE / str(ctx.rank)).touch()
else:  # hung until both are done (a minute at most)
    deadline = time.monotonic() + 60
    while not all((DONE / str(r)).exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    shutil.rmtree(DONE)
