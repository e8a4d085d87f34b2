"""One training step of a layout, and what it held and sent, for the planner's test to compare with its
predictions: persistent buffer bytes, the ledger's bytes per (group, op), and (without pipelining) the bytes
saved for backward by one micro-batch.

    torchrun --nproc-per-node N plan_check.py OUT_DIR key=value ...
"""
import json
import sys
from pathlib import Path

from sixfold.activations import SavedTensors
from sixfold.config import load_config
from sixfold.mesh import ParallelContext
from sixfold.train import Trainer

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
sent = {f"{g}/{op}": b for (g, op), b in trainer.comm.ledger.total.items()}
saved = None
if not trainer.pipeline:
    x, y = next(iter(trainer.loader.micro_batches(1, cfg.train.micro_batches)))
    x, y = trainer._local(x, y)
    with SavedTensors(trainer.model) as tensors:
        loss = trainer.model.loss_sum(x, y)
    saved = tensors.nbytes
    loss.backward()
(out / f"rank{ctx.rank}.json").write_text(json.dumps({"held": held, "sent": sent, "saved": saved}))
ctx.close()
