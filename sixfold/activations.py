"""Activation memory as autograd sees it: the tensors saved for backward, counted with saved-tensor hooks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Saved:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # of the storage behind it, counted once however often it is saved


class SavedTensors:
    """Within the block, record every tensor saved for backward except the model's parameters.

    Tensors sharing a storage count its bytes once (views, and one input saved by several layers).
    """

    def __init__(self, model: nn.Module):
        self.params = list(model.parameters())
        self.seen: set[int] = set()
        self.saved: list[Saved] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        # parameters' storages looked up now: ZeRO-3 gives them storage only while gathered
        if ptr not in self.seen and all(p.untyped_storage().data_ptr() != ptr for p in self.params):
            self.seen.add(ptr)
            self.saved.append(Saved(tuple(t.shape), t.dtype, storage.nbytes()))
        return t

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.saved)

    def token_rows_nbytes(self, tokens: int, dim: int) -> int:
        """Bytes of the [tokens, dim] activations and the norms' [tokens, 1] statistics (floating point only):
        what sequence-TP splits over tp."""
        return sum(s.nbytes for s in self.saved if s.dtype.is_floating_point and len(s.shape) == 2 and
                   s.shape[0] == tokens and s.shape[1] in (dim, 1))
