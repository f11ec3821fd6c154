"""Reusable receive buffers for the collectives (CPU only).

A freshly allocated buffer costs a page fault per page on first write, which
for multi-megabyte messages can take longer than the transfer itself
(docs/results/transport-choices.md). Training
reduces the same bucket sizes every step, so the collectives take their
receive buffers from this pool and give them back when the call is done.
CUDA tensors come from PyTorch's caching allocator, which already does this.
"""

import threading
from collections import OrderedDict

import torch

__all__ = ["BufferPool", "POOL"]


class BufferPool:
    """Free uint8 buffers by exact size, at most ``max_bytes`` in all (oldest dropped first).

    Thread-safe; a buffer is out of the pool while taken, so concurrent
    collectives never share one.

    Args:
        max_bytes: bytes the pool may keep while no call uses them.
    """

    def __init__(self, max_bytes: int = 256 * 2**20):
        self.max_bytes = max_bytes
        self._free: "OrderedDict[int, list[torch.Tensor]]" = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, device) -> torch.Tensor:
        """An uninitialised 1-D uint8 tensor of ``nbytes`` on ``device``."""
        device = torch.device(device)
        if device.type == "cpu":
            with self._lock:
                free = self._free.get(nbytes)
                if free:
                    self._held -= nbytes
                    buf = free.pop()
                    if not free:
                        del self._free[nbytes]
                    return buf
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buffers) -> None:
        """Return buffers obtained from :meth:`take` (others are ignored)."""
        with self._lock:
            for buf in buffers:
                n = buf.numel()
                if buf.device.type != "cpu" or n == 0 or n > self.max_bytes or buf._base is not None:
                    continue
                self._free.setdefault(n, []).append(buf)
                self._free.move_to_end(n)
                self._held += n
            while self._held > self.max_bytes:
                size, free = next(iter(self._free.items()))
                free.pop(0)
                self._held -= size
                if not free:
                    del self._free[size]

    def clear(self) -> None:
        """Drop every pooled buffer."""
        with self._lock:
            self._free.clear()
            self._held = 0

    @property
    def held_bytes(self) -> int:
        """Bytes currently kept for reuse."""
        return self._held


#: the pool the collectives use
POOL = BufferPool()
