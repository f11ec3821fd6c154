"""The interface of a codec policy: an object that picks each call's compressor itself.

:func:`gradcomp.allreduce` accepts a :class:`CodecPolicy` where it accepts a
compressor and hands the call over to it; the policy chooses a compressor
(and, for sparse ones, the ``"allgather"`` algorithm) and calls
:func:`gradcomp.allreduce` again with that choice. The adaptive policy
(:class:`gradcomp.Adaptive`, in :mod:`gradcomp.adaptive`) is one; the
interface lives here so that the transports never import the training layer.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable

import torch

__all__ = ["CodecPolicy"]


class CodecPolicy(abc.ABC):
    """Chooses the compressor of each :func:`gradcomp.allreduce` call."""

    @abc.abstractmethod
    def allreduce(self, tensor: torch.Tensor, *, op: str, algorithm: str, group, meter,
                  timeout: float, key: Hashable, residual: torch.Tensor | None,
                  out: torch.Tensor | None, check: bool, tag=None) -> torch.Tensor:
        """Reduce ``tensor`` with a compressor of the policy's choice; the
        arguments mean what they mean for :func:`gradcomp.allreduce`
        (``algorithm`` is the algorithm of dense choices)."""
