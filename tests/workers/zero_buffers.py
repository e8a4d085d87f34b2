"""Under each ZeRO stage: which unit buffers are alive after a step, and collectives against their formulas."""
import sys

import torch

from sixfold.config import load_config
from sixfold.mesh import ParallelContext
from sixfold.train import Trainer

zero, micro, precision = int(sys.argv[1]), 2, sys.argv[2]
cfg = load_config("configs/tiny.yaml", [f"parallel.dp_shard=4", f"parallel.zero={zero}", f"train.precision={precision}",
                                        f"train.micro_batches={micro}", "log.run_dir=/tmp/unused"])
ctx = ParallelContext.initialize(cfg.parallel)
trainer = Trainer(cfg, ctx)
trainer.comm.ledger.end_step()
trainer.train_step()
calls = {k: v for k, v in trainer.comm.ledger.calls.items()}
units = trainer.sharded.units
live = lambda t: t.untyped_storage().size() > 0
padded = sum(u.padded for u in units)
compute_bytes = 2 if precision == "bf16" else 4
for u in units:
    assert u.master.numel() == u.padded // 4 and u.master.dtype == torch.float32
    assert u.full.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    assert live(u.full) == (zero < 3), (zero, u.index)
    assert live(u.grad) == (zero < 2), (zero, u.index)
ledger = trainer.comm.ledger.total
n = len(units)
assert ledger["fsdp", "reduce_scatter"] == padded * 4 and calls["fsdp", "reduce_scatter"] == n
if zero in (1, 2):
    assert calls["fsdp", "all_gather"] == n and ledger["fsdp", "all_gather"] == padded * compute_bytes
if zero == 3:
    # every unit gathered before forward and again before backward, on each micro-batch
    assert calls["fsdp", "all_gather"] == 2 * n * micro
    assert ledger["fsdp", "all_gather"] == 2 * micro * padded * compute_bytes  # bf16: half the bytes
if ctx.rank == 0:
    print(f"zero {zero} {precision} buffers OK")
ctx.close()
