"""Fully sharded: sixfold's ZeRO-3 trainer beside torch FSDP2 (fully_shard) on the same workload.

    python bench/fsdp.py --ranks 2 4 --runs 3 [--write]

The method (alternating torchrun jobs, timing, memory, the docs table) is bench/common.py's.
"""
from __future__ import annotations

from common import Bench, main, torch_worker


def wrap(model, world: int):
    from composed import fully_shard_summed

    fully_shard_summed(model)  # a unit per block and the root; gradients summed over ranks, as in sixfold
    return model, 1


def fsdp2_worker(cfg) -> dict:
    # FSDP2 hands each step new gradient shards: drop the old ones, as sixfold's ZeRO-3 frees its gradients
    return torch_worker(cfg, wrap, grads_to_none=True)


BENCH = Bench(name="fsdp", script=__file__, title="Fully sharded: sixfold ZeRO-3 vs FSDP2", side="fsdp2",
              label="FSDP2", layout=lambda world: [f"parallel.dp_shard={world}", "parallel.zero=3"],
              describe=lambda world: f"dp_shard={world}, zero=3", worker=fsdp2_worker)

if __name__ == "__main__":
    main(BENCH, __doc__.split("\n")[0])
