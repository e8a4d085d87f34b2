"""Accelerators the planner knows: dense bf16 and fp32 peaks, memory, and the links between them (vendor data sheets;
per direction, per GPU)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16, per second
    fp32_flops: float  # fp32 without tensor cores (sixfold trains fp32 in full fp32, no TF32), per second
    memory: float  # bytes
    intra_bw: float  # bytes/s to a GPU of the same node (NVLink)
    inter_bw: float  # bytes/s to a GPU of another node (one InfiniBand NIC per GPU)


NODE_GPUS = 8  # GPUs of one machine of these kinds (HGX, DGX): the default spread over nodes
MIB = 2**20  # memory as nvidia-smi shows it (its "80GB" is 80 GiB less what the driver keeps)
DEVICES = {
    "h100": Device("h100", 989e12, 67e12, 81559 * MIB, 450e9, 50e9),  # SXM, NVLink 4, 400 Gb/s NDR
    "h200": Device("h200", 989e12, 67e12, 143771 * MIB, 450e9, 50e9),
    "a100": Device("a100", 312e12, 19.5e12, 81920 * MIB, 300e9, 25e9),  # SXM 80GB, NVLink 3, 200 Gb/s HDR
}


def peak(device: Device, precision: str) -> float:
    """The dense peak for train.precision: bf16 or fp32."""
    return device.peak_flops if precision == "bf16" else device.fp32_flops
