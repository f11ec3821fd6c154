"""One collective call run under the agreement: check, run, and on a peer's envelope, agree.

:func:`run` is the frame every gradcomp collective shares
(:func:`gradcomp.allreduce`, :func:`gradcomp.comm.reduce_scatter`, the
backend's allreduce in :mod:`gradcomp.comm.native`): a call whose
:class:`~gradcomp.comm.agreement.Signature` differs from the one its group
last agreed on agrees first, replaying that call's message pattern as
disagreement envelopes for ranks that skip the check
(:mod:`gradcomp.comm.replay`); a call that skipped it and meets an envelope
replays the rest of the pattern and agrees too, so every rank raises the same
``ValueError``. A successful checked call keeps its pattern; any failure
forgets what the group agreed on (the next call checks again).
:func:`call_signature` is what a collective call agrees on.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from gradcomp import wire as W
from gradcomp.comm._args import NAMES, OPS
from gradcomp.comm.agreement import (Signature, agree, call_identity, digest, forget, needs_check, pattern,
                                     remember_pattern, signature)
from gradcomp.comm.dense import Plan
from gradcomp.comm.p2p import Comm
from gradcomp.comm.replay import Disagreement, rest_of
from gradcomp.compressors import Compressor

__all__ = ["run", "check_call", "call_signature"]

T = TypeVar("T")


def run(comm: Comm, sig: Signature, body: Callable[[], T], *, device, check: bool = True,
        always: bool = False) -> T:
    """``body()`` on ``comm``'s group under the agreement on ``sig``.

    Args:
        comm: the group (world size >= 2); ``body`` sends through it.
        sig: this call's signature.
        body: the collective's messages and arithmetic; it raises
            :class:`~gradcomp.comm.replay.Disagreement` where it finds an envelope.
        device: the group's device.
        check: agree when ``sig`` differs from the group's last agreed one
            (False: never; a rank that changed its call is then not detected).
        always: agree on every call (a collective a peer's envelope cannot
            reach, such as the backend's own allreduce).

    Returns:
        What ``body`` returns.

    Raises:
        ValueError: the ranks' calls differ (on every rank).
        Whatever ``body`` raises; TimeoutError / RuntimeError of the agreement.
    """
    group = comm.group
    try:
        if check and (always or needs_check(group, sig)):
            agree(comm, sig, device=device, replaying=pattern(group))  # before anything changes
        try:
            result = body()
        except Disagreement:  # a peer changed its call: finish the pattern, then agree (raises)
            agree(comm, sig, device=device, replaying=rest_of(pattern(group), comm.trace))
            raise RuntimeError("gradcomp collective: a peer sent a disagreement envelope but "
                               "agreed afterwards") from None
        if check:
            remember_pattern(group, sig, comm.trace)
        return result
    except BaseException:
        forget(group)  # this rank's next call on the group checks again
        raise


def check_call(comm: Comm, sig: Signature, *, device) -> None:
    """The agreement :func:`run` makes, on its own (no message of a call
    follows, so no message pattern is kept): agree on ``sig`` unless it is the
    group's last agreed signature; a failure forgets what the group agreed on.

    Raises:
        ValueError: the ranks' signatures differ (on every rank).
        TimeoutError / RuntimeError: as :func:`gradcomp.comm.agreement.agree`.
    """
    group = comm.group
    if not needs_check(group, sig):
        return
    try:
        agree(comm, sig, device=device, replaying=pattern(group))
    except BaseException:
        forget(group)
        raise


def call_signature(call: str, numel: int, op: str, algorithm: int, compressor: Compressor, plan: Plan | None,
                   segments: int, tag, *, details: dict[str, str] | None = None,
                   labels: dict[int, str] | None = None) -> Signature:
    """The :class:`~gradcomp.comm.agreement.Signature` of a collective call:
    its size, op, algorithm code, codec, payload bytes, message pattern (each
    chunk's payload size and the pipelined ring's segments; for the sparse
    allgather the fixed payload size, or -1 when it depends on the data) and
    details (the call's name, :func:`~gradcomp.comm.agreement.call_identity`
    and ``details``); ``labels`` names algorithm codes beyond the allreduce's.

    Raises:
        TypeError: a bad ``tag``.
    """
    if plan is None:  # the sparse allgather
        fixed = compressor.wire_nbytes((numel,), torch.float32)
        wire = -1 if fixed is None else fixed
        shape = (wire,)
    else:
        wire = sum(plan.wire_nbytes)
        shape = (segments, *plan.wire_nbytes)
    names = NAMES if not labels else dict(NAMES, algorithm={**NAMES["algorithm"], **labels})
    return signature(numel=numel, op=OPS.index(op), algorithm=algorithm, codec=W.codec(compressor.codec).id,
                     wire_nbytes=wire, pattern=digest(shape),
                     details={"call": call, "tags or calling threads": call_identity(tag), **(details or {})},
                     labels=names)
