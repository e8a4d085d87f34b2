"""Two training steps of a layout, and what they held and sent, for the planner's test to compare with its
predictions: persistent buffer bytes, the ledger's bytes per (group, op) of the second step, the peak of the
tensor bytes it allocated beyond those allocated when it began (from PyTorch's profiler), and (without
pipelining) the bytes saved for backward by one micro-batch.

    torchrun --nproc-per-node N plan_check.py OUT_DIR key=value ...
"""
import ctypes
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from sixfold.activations import SavedTensors
from sixfold.config import load_config
from sixfold.mesh import ParallelContext
from sixfold.train import Trainer

# The CPU allocator's total counts a free only on a thread the profiler follows, or with this flag on. A tensor
# sent by gloo is freed on gloo's thread when that thread drops the last reference: without the flag it would
# count as held for the rest of the step (more or fewer each run).
ctypes.c_bool.in_dll(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so")),
                     "FLAGS_caffe2_report_cpu_memory_usage").value = True
out = Path(sys.argv[1])
cfg = load_config("configs/tiny.yaml", [*sys.argv[2:], "log.run_dir=/tmp/unused"])
ctx = ParallelContext.initialize(cfg.parallel)
trainer = Trainer(cfg, ctx)
trainer.train_step()

size = lambda t: t.untyped_storage().size()
extra = lambda t, *counted: 0 if any(t is c for c in counted) else size(t)  # a buffer not counted yet
units = trainer.sharded.units
held = {
    "parameters": sum(size(u.full) + extra(u.master, u.full) + extra(u.compute_shard, u.master, u.full) for u in units),
    "gradients": sum(size(u.grad) + extra(u.grad_shard, u.grad) for u in units),
    "optimizer": sum(t.numel() * t.element_size() for m in trainer.optim.moments for t in m.values()),
}
before = dict(trainer.comm.ledger.total)
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    trainer.train_step()
    trainer.sharded.settle()  # no collective in flight when the profiler stops (it may crash otherwise)
# the second step's: the first also gathers, under ZeRO-3, the units the step after it begins with
sent = {f"{g}/{op}": b - before.get((g, op), 0) for (g, op), b in trainer.comm.ledger.total.items()
        if b > before.get((g, op), 0)}
events = out / f"profile{ctx.rank}.json"
prof.export_chrome_trace(str(events))
memory = [e["args"] for e in sorted(json.loads(events.read_text())["traceEvents"], key=lambda e: e["ts"])
          if e.get("name") == "[memory]"]
peak = max(m["Total Allocated"] for m in memory) - (memory[0]["Total Allocated"] - memory[0]["Bytes"])
saved = None
if not trainer.pipeline:
    x, y, ids = trainer._local(*trainer.loader.micro_batches(1, cfg.train.micro_batches)[0])
    with SavedTensors(trainer.model) as tensors:
        loss = trainer.model.loss_sum(x, y, ids)
    saved = tensors.nbytes
    loss.backward()
(out / f"rank{ctx.rank}.json").write_text(json.dumps({"held": held, "sent": sent, "saved": saved, "peak": peak}))
ctx.close()
