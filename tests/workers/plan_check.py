"""Two training steps of each layout, and what they held and sent, for the planner's test to compare with its
predictions: persistent buffer bytes, the ledger's bytes per (group, op) of the second step, the peak of the
tensor bytes it allocated beyond those allocated when it began (from PyTorch's profiler), and (without
pipelining) the bytes saved for backward by one micro-batch. The layouts run one after another in one job, each
on the job's first ranks (the processes start once); each writes OUT_DIR/NAME/rankR.json, or errorR.txt.

    torchrun --nproc-per-node N plan_check.py OUT_DIR LAYOUTS.json   (LAYOUTS.json: {name: [key=value, ...]})
"""
import ctypes
import json
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from sixfold import comm
from sixfold.activations import SavedTensors
from sixfold.config import load_config
from sixfold.join import join_job, leave_job
from sixfold.mesh import Groups, ParallelContext, ParallelDims
from sixfold.train import Trainer


def refs(t: torch.Tensor) -> tuple[int, int]:
    """References to t: all, and all but its views' (a view holds its base and, as every tensor on it, the storage)."""
    count = t._use_count()
    return count, count - torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class Settled:
    """A collective's work whose wait() returns once gloo's thread has let go of its tensors too. That thread holds
    them until it next runs: a moment after the collective ended or, with every core busy, many milliseconds. Were
    this thread to drop them first, they would be freed there, when the scheduler lets it, and not where this
    rank's program lets go of them (more or less at the peak each run). Let go: the references are back to those
    before the collective, or, where the work holds a tensor itself, those beside the views made of it since (the
    ring of context parallelism reads the blocks it sends)."""

    def __init__(self, work, tensors: list[torch.Tensor], before: list[tuple[int, int]]):
        self.work, self.tensors, self.before = work, tensors, before
        self.holds = [refs(t)[1] > b[1] for t, b in zip(tensors, before)]  # the work, not a view of its own

    def _let_go(self) -> bool:
        for t, (count, beside_views), holds in zip(self.tensors, self.before, self.holds):
            now, now_beside_views = refs(t)
            if now > count and not (holds and now_beside_views <= beside_views):
                return False
        return True

    def wait(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.work = None
        deadline = time.monotonic() + 10
        while not self._let_go() and time.monotonic() < deadline:
            time.sleep(1e-4)

    def __getattr__(self, name):  # get_future, is_completed
        return getattr(self.work, name)


def settled(collective):
    """`collective` (a torch.distributed call on the tensors among its first two arguments) with a Settled work,
    waited for unless asked not to."""
    def call(*args, async_op=False, **kwargs):
        tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
        before = [refs(t) for t in tensors]
        work = Settled(collective(*args, async_op=True, **kwargs), tensors, before)
        if async_op:
            return work
        work.wait()
    return call


def settled_batch(ops: list[dist.P2POp], batch=dist.batch_isend_irecv) -> list[Settled]:
    """torch.distributed.batch_isend_irecv with Settled works (gloo's: one for each op)."""
    before = [refs(op.tensor) for op in ops]
    works = batch(ops)
    assert len(works) == len(ops)
    return [Settled(work, [op.tensor], [b]) for work, op, b in zip(works, ops, before)]


dist.all_reduce, dist.broadcast, dist.all_to_all_single, comm._all_gather = (
    settled(f) for f in (dist.all_reduce, dist.broadcast, dist.all_to_all_single, comm._all_gather))
dist.batch_isend_irecv = settled_batch
# The CPU allocator's total counts a free only on a thread the profiler follows, or with this flag on (a tensor gloo's
# thread held past the deadline above).
ctypes.c_bool.in_dll(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so")),
                     "FLAGS_caffe2_report_cpu_memory_usage").value = True


def measure(cfg, ctx: ParallelContext) -> dict:
    """What two steps of `cfg` held and sent on this rank."""
    trainer = Trainer(cfg, ctx)
    trainer.train_step()
    size = lambda t: t.untyped_storage().size()
    extra = lambda t, *counted: 0 if any(t is c for c in counted) else size(t)  # a buffer not counted yet
    units = trainer.sharded.units
    held = {
        "parameters": sum(size(u.full) + extra(u.master, u.full) + extra(u.compute_shard, u.master, u.full)
                          for u in units),
        "gradients": sum(size(u.grad) + extra(u.grad_shard, u.grad) for u in units),
        "optimizer": sum(t.numel() * t.element_size() for m in trainer.optim.moments for t in m.values()),
    }
    before = dict(trainer.comm.ledger.total)
    # the first step's weight gathers completed first: gloo's thread frees its copies of them on its own, and freed
    # inside the second step they took their bytes off its peak (after other layouts in the process, now and then)
    trainer.sharded.settle()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step()
        trainer.sharded.settle()  # no collective in flight when the profiler stops (it may crash otherwise)
    # the second step's: the first also gathers, under ZeRO-3, the units the step after it begins with
    sent = {f"{g}/{op}": b - before.get((g, op), 0) for (g, op), b in trainer.comm.ledger.total.items()
            if b > before.get((g, op), 0)}
    with tempfile.TemporaryDirectory() as where:
        events = Path(where) / "profile.json"
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
    return {"held": held, "sent": sent, "saved": saved, "peak": peak}


out, layouts = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
timeout = timedelta(seconds=120)
rank = join_job(timeout)[0]
groups = Groups(timeout)
for name, overrides in layouts.items():
    cfg = load_config("configs/tiny.yaml", [*overrides, "log.run_dir=/tmp/unused"])
    ctx = ParallelContext.inside(ParallelDims.from_config(cfg.parallel), groups)
    failed = ""
    if ctx:
        (out / name).mkdir(parents=True, exist_ok=True)
        try:
            (out / name / f"rank{rank}.json").write_text(json.dumps(measure(cfg, ctx)))
        except Exception:
            failed = traceback.format_exc()
            (out / name / f"error{rank}.txt").write_text(failed)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failed)
    if any(everyone):  # its groups' collectives may be out of step: new ones for the next layouts
        groups = Groups(timeout)
leave_job()
