"""Host tensors onto a GPU without waiting for the work queued there: copied from pinned memory behind that work.
Each pinned copy is held until an event recorded after its copy has passed, so that nothing the host does
meanwhile (the next batch pinned into a reused buffer) can reach the copy first."""
from __future__ import annotations

from collections import deque

import torch

_held: deque = deque()  # (event, pinned tensor), oldest first


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device` (None: where it is); from the CPU to a GPU through pinned memory, not waiting."""
    device = t.device if device is None else torch.device(device)
    if t.device == device:
        return t
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    pinned = t.pin_memory()
    out = pinned.to(device, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    _held.append((done, pinned))
    while _held and _held[0][0].query():
        _held.popleft()
    return out
