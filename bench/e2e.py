"""End to end: sixfold's trainer beside the same layout composed from PyTorch's own parts, as torchtitan composes
them (DTensor TP + sequence parallel, FSDP2 over a 2-D DeviceMesh, torch.distributed.pipelining), on the same
workload.

    python bench/e2e.py --ranks 1 4 8 --runs 3 [--write]

1 rank: no parallelism (sixfold's trainer alone; torch: the model in plain PyTorch, as a single-process training
loop writes it). 4 ranks: dp_shard=2 x tp=2 (sixfold ZeRO-3; torch FSDP2 on top of DTensor TP+SP). 8 ranks:
pp=2 x dp_shard=2 x tp=2, 1F1B over 4 micro-batches (sixfold ZeRO-3, which under pipelining gathers each stage's
weights once per step; torch FSDP2 with reshard_after_forward=False, torchtitan's default under PP, in
PipelineStage and Schedule1F1B). 4 sequences per data-parallel rank: 4 a step on 1 rank, 8 on 4 and 8 ranks. The
model is bench/composed.py's; the method (alternating torchrun jobs, timing, memory, the docs table) is
bench/common.py's.
"""
from __future__ import annotations

import functools
import importlib

from torch.distributed.tensor.parallel import loss_parallel

from common import ROWS_PER_RANK, Bench, Pipe, main, pipeline_worker, torch_worker
from composed import build

# both sides load these before their memory mark, so that neither counts the libraries (as in bench/pp.py)
for _library in ("torch.distributed.fsdp", "torch.distributed.pipelining"):
    importlib.import_module(_library)

LAYOUTS = {1: {}, 4: {"dp_shard": 2, "tp": 2}, 8: {"pp": 2, "dp_shard": 2, "tp": 2}}  # world size -> layout
PIPELINE = ["parallel.pp_schedule=1f1b", "train.micro_batches=4"]
TORCH_SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


def layout(world: int) -> list[str]:
    if world not in LAYOUTS:
        raise SystemExit(f"bench/e2e.py measures {sorted(LAYOUTS)} ranks, not {world}")
    dims = LAYOUTS[world]
    if not dims:
        return []
    return [f"parallel.{k}={v}" for k, v in dims.items()] + ["parallel.zero=3"] + (PIPELINE if "pp" in dims else [])


def describe(world: int) -> str:
    dims = LAYOUTS[world]
    if not dims:
        return "1 process, plain PyTorch on the torch side"
    pp = f"pp={dims['pp']} (1F1B, 4 micro-batches) x " if "pp" in dims else ""
    return f"{pp}dp_shard={dims['dp_shard']} x tp={dims['tp']}, zero=3"


@functools.cache
def mesh(pp: int, dp: int, tp: int):
    """The named DeviceMesh of the layout, pp outermost and tp innermost: sixfold's rank order."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp_shard", "tp"))


def layout_mesh(cfg):
    p = cfg.parallel
    return mesh(p.pp, p.dp_shard, p.tp)


def summed_loss(h, labels):
    import torch.nn.functional as F

    from sixfold.parallel.tensor import IGNORE_INDEX

    return F.cross_entropy(h.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def stage(cfg) -> Pipe:
    """This rank's pipeline stage (sixfold's cut of the layers, stage i on pp rank i under 1F1B), tensor-parallel
    over tp and fully sharded over dp_shard without resharding after forward."""
    from sixfold.parallel.pipeline.stages import split_stages

    m = layout_mesh(cfg)
    stages = split_stages(cfg.model, cfg.parallel.pp, cfg.train.seq_len)
    here = stages[m["pp"].get_local_rank()]
    module = build(cfg, m["tp"], m["dp_shard"], here, reshard_after_forward=False)
    return Pipe([(here.index, module)], len(stages), summed_loss, m["pp"].get_group(), m["dp_shard"].get_group())


def composed_worker(cfg) -> dict:
    """One rank of the torch side. The norm weights' gradients stay Partial under TP, which DTensor cannot zero in
    place, and FSDP2 hands new gradient shards each step: the gradients are dropped after each step (as
    `zero_grad()` does by default in a plain loop)."""
    if cfg.parallel.world_size == 1:
        return torch_worker(cfg, lambda module, world: (module, 1), grads_to_none=True, build=build,
                            data_parallel=False)
    if cfg.parallel.pp > 1:
        return pipeline_worker(cfg, stage, TORCH_SCHEDULES[cfg.parallel.pp_schedule], loss_context=loss_parallel,
                               mesh=layout_mesh)

    def model(cfg):
        m = layout_mesh(cfg)
        return build(cfg, m["tp"], m["dp_shard"])

    # FSDP2 sums the gradients over dp_shard (factor 1 on the loss); every tp rank computes its batch's loss
    return torch_worker(cfg, lambda module, world: (module, 1), grads_to_none=True, build=model,
                        data_parallel=lambda: layout_mesh(cfg)["dp_shard"].get_group(), loss_context=loss_parallel,
                        mesh=layout_mesh)


BENCH = Bench(name="e2e", script=__file__, title="End to end: sixfold vs torch's parts composed as in torchtitan",
              side="composed", label="torch composed", layout=layout, describe=describe, worker=composed_worker,
              global_batch=lambda world: ROWS_PER_RANK * LAYOUTS[world].get("dp_shard", 1), ranks=(1, 4, 8))

if __name__ == "__main__":
    main(BENCH, __doc__.split("\n")[0])
