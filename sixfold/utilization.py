"""What a step's log line says of the machine: the model FLOPs utilization on a GPU whose peak the planner knows,
and the peak memory of rank 0."""
from __future__ import annotations

import resource
import sys

import torch

from .config import Config
from .planner.devices import DEVICES, peak
from .planner.timing import model_flops_per_token


def peak_flops(name: str, precision: str) -> float | None:
    """The dense peak for train.precision of the device named `name` (as torch.cuda.get_device_name gives it), or
    None where it is not known: a CPU, another GPU, or the PCIe and NVL cards of H100 and H200, slower than the SXM
    ones the planner knows."""
    name = name.lower()
    if "a100" not in name and ("pcie" in name or "nvl" in name):
        return None
    return next((peak(d, precision) for key, d in DEVICES.items() if key in name), None)


class Utilization:
    """MFU as `sixfold plan` and bench/gpu.py count it (the model's FLOPs, causal attention's half square,
    recomputation not counted) over every rank's peak; None on a device of unknown peak."""

    def __init__(self, cfg: Config, device: torch.device, world_size: int):
        self.device = device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        rate = peak_flops(name, cfg.train.precision)
        self.flops = None if rate is None else \
            model_flops_per_token(cfg.model, cfg.train.seq_len) / (rate * world_size)

    def mfu(self, tokens_per_s: float) -> float | None:
        return None if self.flops is None else tokens_per_s * self.flops

    def peak_memory_gb(self) -> float:
        """This process's peak so far, in GiB: the CUDA allocator's max_memory_allocated on a GPU, the peak
        resident set (libraries included) on a CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform == "darwin" else 1)
        return kb / 2**20
