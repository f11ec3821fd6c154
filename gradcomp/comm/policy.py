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
import threading
import weakref
from collections.abc import Hashable

import torch

from gradcomp.comm.settings import agree_settings

__all__ = ["CodecPolicy"]

# policy -> ids of the groups whose ranks agreed on its settings, each with a weak reference to
# its group (a group object made later at the same address has not agreed)
_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class CodecPolicy(abc.ABC):
    """Chooses the compressor of each :func:`gradcomp.allreduce` call."""

    @abc.abstractmethod
    def allreduce(self, tensor: torch.Tensor, *, op: str, algorithm: str, group, meter,
                  timeout: float, key: Hashable, residual: torch.Tensor | None,
                  out: torch.Tensor | None, check: bool, tag=None) -> torch.Tensor:
        """Reduce ``tensor`` with a compressor of the policy's choice; the
        arguments mean what they mean for :func:`gradcomp.allreduce`
        (``algorithm`` is the algorithm of dense choices)."""

    def settings(self) -> dict:
        """Name -> value of everything every rank's policy must share, because
        it decides which codec each call uses (:meth:`agree` compares them)."""
        return {}

    def agree(self, group, *, timeout: float, device="cpu", meter=None) -> None:
        """Check, once per group, that every rank of ``group`` holds a policy of
        this type with the same :meth:`settings`
        (:func:`gradcomp.comm.settings.agree_settings`): a rank with other
        settings (another link prior) would choose another codec and wait out
        the timeout in a collective its peers never join.
        A policy's :meth:`allreduce` calls it before its first call on a group,
        the DDP hook at its first bucket; every rank must reach it.

        Raises:
            ValueError: the ranks' settings differ (on every rank, naming the
                first setting that differs and each rank's value).
            TimeoutError / RuntimeError: a peer did not answer within ``timeout`` seconds.
        """
        with _LOCK:
            seen = _AGREED.setdefault(self, {})
            ref = seen.get(id(group))
            if ref is not None and ref() is group:
                return
        agree_settings(group, f"gradcomp.{type(self).__name__}", self.settings(), timeout=timeout,
                       device=device, meter=meter)
        with _LOCK:
            _AGREED.setdefault(self, {})[id(group)] = weakref.ref(group)
