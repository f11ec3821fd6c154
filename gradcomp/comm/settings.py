"""A component's settings agreed by every rank of its group before it sends anything.

Training components decide message patterns from settings each rank passes
on its own: :class:`gradcomp.LocalSGD`'s schedule (which steps exchange which
fragment), :class:`gradcomp.Adaptive`'s link prior (which codec the first
call uses), a DDP hook's compressor and start step. Ranks that differ would
pair unrelated exchanges or wait out the full timeout, so such a component
calls :func:`agree_settings` once, where every rank constructs or first uses
it: one agreement (:mod:`gradcomp.comm.agreement`: a 56-byte signature to
each peer, whose digest covers the settings' texts; the texts themselves only
when the digests differ), after which every rank either goes on or raises the
same ``ValueError`` naming the setting and each rank's value.
"""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Mapping

import torch.distributed as dist

from gradcomp.comm.agreement import agree, forget, pattern, signature
from gradcomp.comm.guard import exclusive
from gradcomp.comm.p2p import Comm

__all__ = ["agree_settings", "setting_text", "compressor_text"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SEED = re.compile(r"(, )?\bseed=\d+(, )?")


def setting_text(value) -> str:
    """How a setting is compared and printed: a str as it is, a function or
    class by its qualified name, a ``functools.partial`` by its function and
    arguments, anything else by its ``repr`` (exact for floats) without object
    addresses (they differ between processes)."""
    if isinstance(value, str):  # already a text (e.g. a compressor's, from compressor_text)
        return value
    if isinstance(value, functools.partial):
        return f"{setting_text(value.func)}(*{setting_text(value.args)}, **{setting_text(value.keywords)})"
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    return _ADDRESS.sub("", repr(value))


def compressor_text(compressor) -> str:
    """A compressor's settings as ranks must share them: its ``repr`` without
    its random seed (ranks may seed stochastic rounding apart: every rank
    decodes the same bytes either way)."""
    return _SEED.sub(lambda m: ", " if m.group(1) and m.group(2) else "", setting_text(compressor))


def agree_settings(group, what: str, settings: Mapping[str, object], *, timeout: float, device="cpu",
                   meter=None) -> None:
    """Check that every rank of ``group`` passed the same ``settings``.

    Every rank must call it at the same point (like a collective). It runs
    on every call (one small round trip; twice when the settings differ).

    Args:
        group: a torch.distributed process group this process is in (None: the world).
        what: the component, e.g. ``"gradcomp.LocalSGD"`` (the error names it).
        settings: name -> value (compared as :func:`setting_text`).
        timeout: seconds the exchange may take.
        device: the group's device (CPU for gloo, the current CUDA device for NCCL).
        meter: optional :class:`~gradcomp.TrafficMeter` (phase ``"agreement"``).

    Raises:
        ValueError: the ranks passed different settings (on every rank: the
            first setting that differs and each rank's value).
        RuntimeError: another thread of this process held ``group`` for more than ``timeout`` seconds.
        TimeoutError / RuntimeError: a peer did not answer within ``timeout`` seconds.
    """
    group = dist.group.WORLD if group is None else group
    if dist.get_world_size(group) == 1:
        return
    sig = signature(details={"call": what, **{k: setting_text(val) for k, val in settings.items()}})
    with exclusive(group, what, timeout):
        comm = Comm(group, timeout, meter)
        try:
            # a rank may have skipped a check on the group's last agreed call: reach it
            agree(comm, sig, device=device, replaying=pattern(group))
        except BaseException:
            forget(group)
            raise
        comm.release()
