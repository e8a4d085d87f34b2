"""While tracing on gloo, an asynchronous collective's completion is stamped (by its future: no thread polls) before
anyone waits for it, and its span ends there; a point-to-point message reports completion only when waited for, so
its span ends at the wait.

    torchrun --nproc-per-node 2 completion.py
"""
import time

import torch

from sixfold.comm import Comm
from sixfold.config import ParallelConfig
from sixfold.mesh import ParallelContext
from sixfold.trace import Tracer

ctx = ParallelContext.initialize(ParallelConfig(dp_replicate=2))
tracer = Tracer(True, ctx.rank)
comm = Comm(ctx, tracer)
pending = comm.all_reduce(torch.ones(4), "dp_replicate", async_op=True, label="grads")
deadline = time.monotonic() + 60
while pending.done_at is None and time.monotonic() < deadline:
    time.sleep(0.01)
assert pending.done_at is not None, "the all-reduce's completion was never stamped"
pending.wait()
message = comm.exchange([(torch.ones(4), 1 - ctx.rank)], [(torch.empty(4), 1 - ctx.rank)], "dp_replicate")
assert comm.watcher.thread is None
message.wait()
assert message.done_at is None
(reduce, p2p) = tracer.events
end = lambda e: e["ts"] + e["dur"]
assert abs(end(reduce) - pending.done_at) < 1 and end(reduce) < reduce["ts"] + reduce["args"]["wait_after_us"]
assert abs(p2p["dur"] - p2p["args"]["wait_after_us"] - p2p["args"]["waited_us"]) < 1  # microseconds
print(f"rank {ctx.rank} completion OK", flush=True)
ctx.close()
