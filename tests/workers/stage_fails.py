"""Pipeline stage 1 (rank 1) raises in step 2 while stage 0 does not: an operation that train.deterministic refuses
(put_, which has no deterministic kernel on a CPU either), in a forward under 1f1b, in a backward under zb-v (its
W actions and early sends). Rank 1 stays in the job, as inside sixfold.multirun. Each rank prints its error: rank
1's own, rank 0's naming it, at the step's end, not after parallel.timeout_s.

    torchrun --nproc-per-node 2 stage_fails.py CONFIG RUN_DIR
"""
import sys
from datetime import timedelta
from pathlib import Path

import torch

from sixfold.config import load_config
from sixfold.join import join_job, leave_job
from sixfold.mesh import Groups, ParallelContext, ParallelDims
from sixfold.model.llama import Llama
from sixfold.train import run

CASES = [("1f1b", 1, "forward"), ("zb-v", 2, "backward")]  # schedule, stages a rank holds, where rank 1 fails
MICRO = 2
rank = join_job(timedelta(seconds=60))[0]
calls, plain = [0], Llama.run


def refused(*args):
    torch.zeros(4).put_(torch.tensor([0]), torch.ones(1))


def failing(where: str, per_step: int):
    def run_stage(self, stage, x, t):
        calls[0] += 1
        first = calls[0] == per_step + 1  # step 2's first compute of this rank
        if first and where == "forward":
            refused()
        out = plain(self, stage, x, t)
        if first and where == "backward":
            out.register_hook(refused)
        return out
    return run_stage


groups = Groups(timedelta(seconds=60))
for schedule, v, where in CASES:
    calls[0] = 0
    if rank == 1:
        Llama.run = failing(where, MICRO * v)
    cfg = load_config(sys.argv[1], ["parallel.pp=2", f"parallel.pp_schedule={schedule}",
                                    f"parallel.pp_virtual_stages={v}", "model.n_layers=4",
                                    f"train.micro_batches={MICRO}", "train.deterministic=true",
                                    "parallel.timeout_s=60", "train.steps=3", "log.progress=false",
                                    "checkpoint.save_final=false", f"log.run_dir={Path(sys.argv[2]) / schedule}"])
    try:
        run(cfg, ParallelContext.inside(ParallelDims.from_config(cfg.parallel), groups))
        said = "no error"
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    sys.stdout.write(f"{schedule} rank {rank}: {said}\n")
    sys.stdout.flush()
    Llama.run = plain
    groups = Groups(groups.timeout)  # the failed run's collectives may be out of step
leave_job()
