"""torchtitan 0.3.0's trainer on a CPU with gloo, for bench/vs_torchtitan.py: run by torchrun in the Python that has
torchtitan (not sixfold's), with torchtitan's own arguments. It adds the config `llama3_bench` (torchtitan's
debugmodel, which is issue #11's workload model: 6,163,712 parameters), whose step it makes the workload's
where torchtitan's defaults differ:

- causal attention over the whole sequence by SDPA (the CPU's flash kernel), not flex attention within documents
  (which has no CPU backward either); no activation checkpointing (the workload recomputes nothing); fp32 compute
  (the mixed precision of fully_shard, which torchtitan applies in every layout, one process included, computes in
  bf16 by default);

and bends it where it assumes CUDA or a newer torch, changing no work of a step:

- the device module is torch.cpu, with the few calls it lacks (device name, memory statistics) answered;
- the process-group timeouts are left as set (torchtitan sets them after a barrier given device ids, which gloo
  takes as integers);
- FSDP reduces with a plain sum where torchtitan asks for a divide factor of 1 (gloo has no PREMUL_SUM);
- a pipeline schedule given micro-batches already made (torchtitan 0.3.0's call) runs them as torch 2.13's
  step() runs the ones it makes from a whole batch.

With SIXFOLD_PEAK_DIR set, each rank writes its peak memory there (rank{RANK}.json) as sixfold's bench jobs measure
theirs: resident-set growth, here from the end of torchtitan's init_distributed (its process group and device
meshes made; its model, tokenizer and data loader not yet built) to its Trainer's close.
"""
import json
import os
import runpy
import sys
import types
from pathlib import Path

import torch
import torchtitan.tools.utils as utils

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sixfold.measure import mark_memory, peak_mb  # noqa: E402  (standard library only: no sixfold install needed)

cpu = torch.cpu
cpu.get_device_name = lambda *a: "cpu"
MEMORY = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
cpu.get_device_properties = lambda *a: types.SimpleNamespace(total_memory=MEMORY, name="cpu")
cpu.reset_peak_memory_stats = lambda *a: None
cpu.empty_cache = lambda *a: None
cpu.memory_stats = lambda *a: {}
utils.device_type, utils.device_module = "cpu", cpu

import torchtitan.distributed.utils as dist_utils  # noqa: E402  (after the device is set: they read it)
import torchtitan.models.llama3 as llama3  # noqa: E402
import torchtitan.models.llama3.config_registry as registry  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.pipelining import schedules  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402

dist_utils.set_pg_timeouts = lambda *a, **k: None
llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()


def llama3_bench():
    config = registry.llama3_debugmodel()
    config.model_spec = llama3.model_registry("debugmodel")  # built again: with the attention above
    config.activation_checkpoint = None
    config.training.mixed_precision_param = "float32"  # (bf16 by default)
    return config


registry.llama3_bench = llama3_bench
_divide = FSDPModule.set_gradient_divide_factor


def _summed(self, factor):
    _divide(self, factor)
    self.set_force_sum_reduction_for_comms(True)


FSDPModule.set_gradient_divide_factor = _summed


def _premade(step):
    def run(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
            loss_kwargs=None, **kwargs):
        if kwarg_mbs is None:
            return step(self, *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs, **kwargs)
        for stage in getattr(self, "_stages", None) or [self._stage]:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
    return run


for schedule in list(vars(schedules).values()):
    if isinstance(schedule, type) and "step" in vars(schedule):
        schedule.step = _premade(schedule.step)


def _measured(trainer):
    meshes, close = trainer.init_distributed, trainer.close
    base = []

    def start(self):
        made = meshes(self)
        base.append(mark_memory())
        return made

    def end(self):
        close(self)
        folder = Path(os.environ["SIXFOLD_PEAK_DIR"])
        (folder / f"rank{os.environ['RANK']}.json").write_text(json.dumps({"peak_mb": peak_mb(base[0])}))
    trainer.init_distributed, trainer.close = start, end


if os.environ.get("SIXFOLD_PEAK_DIR"):
    from torchtitan.trainer import Trainer
    _measured(Trainer)
runpy.run_module("torchtitan.train", run_name="__main__")
