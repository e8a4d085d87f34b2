"""train.deterministic: the same run gives the same bits again on a GPU too, as it does on a CPU anyway.

On a GPU some kernels sum in an order that changes from call to call (atomic additions): cuDNN's attention
backward adds the query gradients so, and torch.compile may choose kernels by timing them. Without them a run
repeats itself, and a resumed run ends as the uninterrupted one did, bit for bit; the kernels that replace them
are slower."""
from __future__ import annotations

import os

import torch

UNSUPPORTED = "does not have a deterministic implementation"  # torch's error for an operation it cannot run so


def make_deterministic(compiled: bool) -> None:
    """Fixed-order kernels from here on, in this process; before its first matrix product on a GPU (cuBLAS reads
    its workspace setting once). An operation without one raises (explained by `unsupported`)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)  # not warn-only: then flash attention's backward would stay as it is
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_cudnn_sdp(False)
    if compiled:
        import torch._inductor.config as inductor
        if hasattr(inductor, "deterministic"):  # (torch 2.13 has it)
            inductor.deterministic = True  # no kernel choice by timing


def unsupported(e: BaseException) -> str | None:
    """What to say of an operation that has no fixed-order kernel on this device (None: `e` is another error)."""
    text = str(e)
    if not isinstance(e, RuntimeError) or UNSUPPORTED not in text:
        return None
    op = text.split(UNSUPPORTED)[0].strip()
    return (f"train.deterministic=true, and {op} has no deterministic kernel on this device in torch "
            f"{torch.__version__}; set train.deterministic=false to run it (the results then vary between runs in "
            f"the order of floating-point sums)")
