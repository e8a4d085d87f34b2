"""ctx.local_first: the other ranks wait for the first longer than parallel.timeout_s and run after it; when a
rank fails, the others stop instead of waiting; when the first rank hangs (stopped by a signal, its heartbeat with
it), the others stop within parallel.timeout_s and rank 1 kills it; when a waiting rank hangs, the first rank stops
its work before finishing it, and kills the hung rank.

    torchrun --nproc-per-node 3 local_first.py DIR ok|fail-first|fail-last|hang-first|hang-waiting
"""
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from sixfold.config import ParallelConfig
from sixfold.mesh import ParallelContext

marker, mode = Path(sys.argv[1]) / "first-done", sys.argv[2]
ctx = ParallelContext.initialize(ParallelConfig(dp_replicate=3, timeout_s=2))
first = int(os.environ["LOCAL_RANK"]) == 0


def hang() -> None:
    (marker.parent / "pid").write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


def load():
    if first:  # longer than parallel.timeout_s (hang-waiting: a minute), in short steps that a stop can cut
        for _ in range(600 if mode == "hang-waiting" else 50):
            time.sleep(0.1)
        if mode == "fail-first":
            raise ValueError("corpus broken")
        if mode == "hang-first":
            hang()
        marker.write_text("x")
    assert marker.exists(), "ran before the first rank finished"
    if mode == "fail-last" and ctx.rank == 2:
        raise ValueError("corpus broken")
    return ctx.rank


if mode == "hang-waiting":
    ctx.local_first(lambda: None)  # the heartbeat's group made, on every rank
    if ctx.rank == 2:
        threading.Timer(1, hang).start()
try:
    assert ctx.local_first(load) == ctx.rank
    dist.barrier()  # the job's groups still work
    print(f"rank {ctx.rank} local_first OK", flush=True)
except (ValueError, RuntimeError) as e:
    print(f"rank {ctx.rank} {e}", flush=True)
    if (mode, ctx.rank) in (("hang-first", 1), ("hang-waiting", 0)):
        os.kill(int((marker.parent / "pid").read_text()), signal.SIGKILL)
ctx.close()
