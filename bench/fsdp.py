"""Fully sharded: sixfold's ZeRO-3 trainer beside torch FSDP2 (fully_shard) on the same workload.

    python bench/dp.py --ranks 2 4 --runs 3

The method (alternating torchrun jobs, timing, memory, the docs table) is bench/common.py's.
"""
from __future__ import annotations

from common import Bench, main, torch_worker


def wrap(model, world: int):
    from torch.distributed.fsdp import fully_shard

    # a unit per block, as in sixfold; the root unit holds the embedding, final norm and head (two units in sixfold)
    units = [fully_shard(block) for block in model.layers.values()] + [fully_shard(model)]
    for unit in units:  # FSDP2 averages over ranks; sum instead, as in sixfold (gloo has no AVG op)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model, 1


def fsdp2_worker(cfg) -> dict:
    # FSDP2 hands each step new gradient shards: drop the old ones, as sixfold's ZeRO-3 frees its gradients
    return torch_worker(cfg, wrap, grads_to_none=True)


BENCH = Bench(name="fsdp", script=__file__, title="Fully sharded: sixfold ZeRO-3 vs FSDP2", side="fsdp2",
              label="FSDP2", layout=lambda world: [f"parallel.dp_shard={world}", "parallel.zero=3"],
              describe=lambda world: f"dp_shard={world}, zero=3", worker=fsdp2_worker)

if __name__ == "__main__":
    main(BENCH, __doc__.split("\n")[0])
