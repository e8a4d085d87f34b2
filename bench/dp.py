"""Data parallel: sixfold's trainer beside torch DistributedDataParallel on the same workload.

    python bench/dp.py --ranks 2 4 --runs 3 [--write]

The method (alternating torchrun jobs, timing, memory, the docs table) is bench/common.py's.
"""
from __future__ import annotations

from common import Bench, main, torch_worker


def wrap(model, world: int):
    from torch.nn.parallel import DistributedDataParallel

    # sixfold reduces one FSDP unit (a block) at a time: give DDP buckets of the largest unit's size
    unit_mb = max(sum(p.numel() * p.element_size() for p in m.parameters())
                  for m in [model.embed, *model.layers.values()]) / 2 ** 20
    ddp = DistributedDataParallel(model, bucket_cap_mb=unit_mb, gradient_as_bucket_view=True)
    return ddp, world  # DDP averages over ranks; a loss times world makes the result a sum, as in sixfold


def ddp_worker(cfg) -> dict:
    # keep the grads as bucket views, zeroed in place like sixfold's
    return torch_worker(cfg, wrap, grads_to_none=False)


BENCH = Bench(name="dp", script=__file__, title="Data parallel: sixfold vs DDP", side="ddp", label="DDP",
              layout=lambda world: [f"parallel.dp_replicate={world}"], describe=lambda world: f"dp_replicate={world}",
              worker=ddp_worker)

if __name__ == "__main__":
    main(BENCH, __doc__.split("\n")[0])
