"""Activation memory of a stage: the bytes autograd keeps alive for backward.

On CPU there is no allocator counter to read, so the stage counts the
tensors autograd saves for backward through
``torch.autograd.graph.saved_tensors_hooks``: each saved tensor's storage
is counted once while any saved reference to it is alive (the pack hook adds
it, the reference's release subtracts it), parameters excluded. The peak is
what the schedule's in-flight micro-batches cost in activations: GPipe keeps
every micro-batch's until the flush, 1F1B at most ``p - s`` at stage ``s``.
"""

from __future__ import annotations

import threading
from typing import Iterable

import torch

__all__ = ["ActivationMeter"]


class _Saved:
    __slots__ = ("meter", "tensor", "key", "__weakref__")

    def __init__(self, meter: "ActivationMeter", tensor: torch.Tensor, key: int):
        self.meter, self.tensor, self.key = meter, tensor, key

    def __del__(self):
        self.meter._release(self.key)


class ActivationMeter:
    """Live and peak bytes of tensors saved for backward (storages counted once).

    Args:
        exclude: tensors (parameters) whose storages are not activations.

    Attributes:
        current: bytes alive now; peak: the most alive at once (bytes).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage ptr -> [nbytes, references]
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (weights, stashed weight versions)."""
        self._skip.update(t.untyped_storage().data_ptr() for t in tensors)

    def forget(self, tensors: Iterable[torch.Tensor]) -> None:
        """Undo :meth:`exclude` (the storages are about to be freed and reused)."""
        self._skip.difference_update(t.untyped_storage().data_ptr() for t in tensors)

    def hooks(self):
        """The context manager under which forwards are recorded."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._skip or isinstance(t, torch.nn.Parameter):
            return t
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                self._live[key] = [storage.nbytes(), 1]
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            else:
                entry[1] += 1
        return _Saved(self, t, key)

    @staticmethod
    def _unpack(s):
        return s.tensor if isinstance(s, _Saved) else s

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._live[key]
                self.current -= entry[0]

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self.peak = self.current
