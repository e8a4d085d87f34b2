"""ctx.local_first: the other ranks wait for the first longer than parallel.timeout_s and run after it; when the
first fails they stop with its error.

    torchrun --nproc-per-node 3 local_first.py DIR [fail]
"""
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from sixfold.config import ParallelConfig
from sixfold.mesh import ParallelContext

marker, fail = Path(sys.argv[1]) / "first-done", sys.argv[2:] == ["fail"]
ctx = ParallelContext.initialize(ParallelConfig(dp_replicate=3, timeout_s=1))
first = int(os.environ["LOCAL_RANK"]) == 0


def load():
    if first:
        time.sleep(3)  # three times parallel.timeout_s
        if fail:
            raise ValueError("corpus broken")
        marker.write_text("x")
    assert marker.exists(), "ran before the first rank finished"
    return ctx.rank


try:
    assert ctx.local_first(load) == ctx.rank
    dist.barrier()  # the job's groups still work
    print(f"rank {ctx.rank} local_first OK", flush=True)
except (ValueError, RuntimeError) as e:
    print(f"rank {ctx.rank} {e}", flush=True)
    if first:
        time.sleep(3)  # let the others see the error before torchrun stops them
ctx.close()
