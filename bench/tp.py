"""Tensor parallel: sixfold's sequence-TP beside torch DTensor TP+SP (parallelize_module) on the same workload.

    python bench/tp.py --ranks 2 4 --runs 3 [--write]

There is no data parallelism: every rank reads the same global batch of 4 sequences, whatever the rank count.
The method (alternating torchrun jobs, timing, memory, the docs table) is bench/common.py's.
"""
from __future__ import annotations

import functools

from torch.distributed.tensor.parallel import loss_parallel

from common import ROWS_PER_RANK, Bench, main, torch_worker
from composed import build


@functools.cache
def tp_mesh():
    """Every rank, one tp dimension."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def tp_model(cfg):
    """sixfold's Llama in torch layers, DTensor tensor-parallel over every rank (bench/composed.py)."""
    return build(cfg, tp_mesh=tp_mesh())


def tp_worker(cfg) -> dict:
    # no wrapper and no factor on the loss: every rank computes the whole batch's loss, as in sixfold.
    # The norm weights' gradients stay Partial (summed over ranks where they are read), which DTensor cannot
    # zero in place: drop the gradients after each step, as torch's zero_grad does by default.
    return torch_worker(cfg, lambda model, world: (model, 1), grads_to_none=True, build=tp_model,
                        data_parallel=False, loss_context=loss_parallel, mesh=lambda cfg: tp_mesh())


BENCH = Bench(name="tp", script=__file__, title="Tensor parallel: sixfold sequence-TP vs DTensor TP+SP", side="dtensor",
              label="DTensor TP", layout=lambda world: [f"parallel.tp={world}"],
              describe=lambda world: f"tp={world}, sequence-TP", worker=tp_worker,
              global_batch=lambda world: ROWS_PER_RANK)

if __name__ == "__main__":
    main(BENCH, __doc__.split("\n")[0])
