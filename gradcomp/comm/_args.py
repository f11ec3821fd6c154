"""Argument checks and the constants the compressed collectives share (algorithm names, ops, dtypes).

Public names in a private module: :mod:`gradcomp.comm.dispatch`, :mod:`gradcomp.comm.native` and
:mod:`gradcomp.comm.reduce_scatter` import them from here, never from the package.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp import wire as W
from gradcomp.comm.topology import INTER_ALGORITHMS
from gradcomp.compressors import Compressor, TopK, split
from gradcomp.meter import TrafficMeter

#: every algorithm name
ALGORITHMS = ("ring", "two_phase", "allgather", "hierarchical", "halving_doubling", "sparse_reduce_scatter")
#: the name that lets :mod:`gradcomp.comm.auto` pick one of :data:`ALGORITHMS` per bucket
AUTO = "auto"
#: every name ``algorithm=`` accepts: the algorithms and ``"auto"``
ALGORITHM_CHOICES = ALGORITHMS + (AUTO,)
#: algorithms for dense compressors (fixed wire sizes)
DENSE_ALGORITHMS = ("ring", "two_phase", "hierarchical", "halving_doubling")
#: algorithms for sparse compressors (TopK, Threshold)
SPARSE_ALGORITHMS = ("allgather", "sparse_reduce_scatter")
#: dense algorithms over one flat group (the adaptive policy's, the hierarchical inter-host leg's)
FLAT_DENSE_ALGORITHMS = INTER_ALGORITHMS
#: reduction ops
OPS = ("avg", "sum")
#: accepted input dtypes (everything is accumulated in float32)
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: default seconds one exchange may take before TimeoutError
DEFAULT_TIMEOUT = 300.0

#: the agreement's code of each flat algorithm (codes are part of the 56-byte signature: fixed)
ALGORITHM_CODES = {"ring": 0, "two_phase": 1, "allgather": 2, "halving_doubling": 4,
                   "sparse_reduce_scatter": 5}
#: the agreement's algorithm code of the backend's own allreduce (:mod:`gradcomp.comm.native`)
NATIVE = 3
#: the agreement's algorithm code of a hierarchical call: this plus the index of
#: its inter-host algorithm in :data:`~gradcomp.comm.topology.INTER_ALGORITHMS`
HIERARCHICAL = 8

# how a disagreement names the codes of the agreement's fields
NAMES = {"op": dict(enumerate(OPS)),
         "algorithm": {**{c: a for a, c in ALGORITHM_CODES.items()}, NATIVE: "native",
                       **{HIERARCHICAL + i: f"hierarchical ({a} across hosts)" for i, a in enumerate(INTER_ALGORITHMS)}},
         "codec": {c.id: c.name for c in W.CODECS.values()}}


def group_place(group) -> tuple[int, int, str]:
    """``(rank, size, backend name)`` of this process in ``group``.

    ``group`` is a group torch.distributed created (the world, ``new_group``)
    or a c10d ``ProcessGroup`` built outside its registry, such as the one a
    reconfigurable group builds for each membership (torchft's, see
    :mod:`gradcomp.integrations.torchft`): then its own ``rank()``, ``size()``, ``name()``.
    """
    if isinstance(group, dist.ProcessGroup) and not _registered(group):
        return group.rank(), group.size(), group.name()
    return dist.get_rank(group), dist.get_world_size(group), dist.get_backend(group)


def _registered(group) -> bool:
    if not dist.is_initialized():
        return False
    try:
        dist.get_backend(group)
    except ValueError:  # "not initialized in the world group map"
        return False
    return True


def member_group(group, what: str):
    """``group`` (None: the world) once torch.distributed is up and this process is in it
    (or an unregistered c10d ``ProcessGroup``: see :func:`group_place`).

    Raises:
        RuntimeError: torch.distributed is not initialised (``what`` names the caller).
        ValueError: this process is not a member of ``group``.
    """
    if isinstance(group, dist.ProcessGroup) and not _registered(group):
        return group
    if not dist.is_initialized():
        raise RuntimeError(f"{what} needs torch.distributed initialised "
                           "(dist.init_process_group or gradcomp.launch)")
    group = dist.group.WORLD if group is None else group
    if dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of group")
    return group


def check_args(tensor, compressor, op, algorithm, timeout, residual, out, meter=None) -> None:
    """Check the arguments of a compressed collective (see :func:`gradcomp.allreduce`).

    Raises:
        TypeError / ValueError: naming the argument and the allowed values.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        raise TypeError(f"tensor must be a dense torch.Tensor, got {type(tensor).__name__}"
                        + ("" if not isinstance(tensor, torch.Tensor) else f" with layout {tensor.layout}"))
    if tensor.is_meta:
        raise ValueError("tensor must hold data, got a meta tensor")
    if tensor.dtype not in INPUT_DTYPES:
        raise TypeError(f"tensor must have dtype float32, float16 or bfloat16 (sums are accumulated "
                        f"in float32), got {tensor.dtype}")
    compressor, ef = split(compressor, "compressor", " or ErrorFeedback")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    check_algorithm(algorithm, compressor, auto=True)
    v.timeout("timeout", timeout)
    if meter is not None and not isinstance(meter, TrafficMeter):
        raise TypeError(f"meter must be a gradcomp.TrafficMeter or None, got {type(meter).__name__}")
    if residual is not None:
        if ef is not None:
            raise ValueError("give either an ErrorFeedback compressor or residual=, not both")
        if (not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32
                or not residual.is_contiguous() or residual.numel() != tensor.numel()
                or residual.device != tensor.device):
            got = (f"{residual.dtype} with {residual.numel()} elements on {residual.device}"
                   if isinstance(residual, torch.Tensor) else type(residual).__name__)
            raise ValueError(f"residual must be a contiguous float32 tensor of {tensor.numel()} "
                             f"elements on {tensor.device}, got {got}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != tensor.shape
                            or out.dtype != tensor.dtype or out.device != tensor.device
                            or not out.is_contiguous()):
        got = (f"{out.dtype} of shape {tuple(out.shape)} on {out.device}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(f"out must be a contiguous {tensor.dtype} tensor of shape {tuple(tensor.shape)} "
                         f"on {tensor.device}, got {got}")


def check_algorithm(algorithm: str, compressor: Compressor, *, auto: bool = False) -> None:
    """Check that ``algorithm`` takes ``compressor`` (not an ErrorFeedback).

    Args:
        auto: also accept ``"auto"`` (:data:`ALGORITHM_CHOICES`) for any
            compressor some algorithm takes (sparse ones, dense ones with a
            fixed wire size).

    Raises:
        ValueError: ``algorithm`` is not in :data:`ALGORITHMS` (or
            :data:`ALGORITHM_CHOICES` with ``auto``); a sparse
            compressor with a dense algorithm or a dense one with a sparse
            algorithm; a dense compressor without a fixed wire size;
            ``"sparse_reduce_scatter"`` with anything but an exact ``TopK``
            with a ``ratio`` (its regions need fixed payload sizes and the
            density applies per region).
    """
    names = ALGORITHM_CHOICES if auto else ALGORITHMS
    if not isinstance(algorithm, str) or algorithm not in names:
        raise ValueError(f"algorithm must be one of {names}, got {algorithm!r}")
    if algorithm == AUTO:
        if not compressor.sparse and compressor.wire_nbytes((1,), torch.float32) is None:
            raise ValueError(f"algorithm 'auto' needs a sparse compressor or a dense one with a fixed wire "
                             f"size (wire_nbytes not None), got {compressor!r}")
        return
    if algorithm in DENSE_ALGORITHMS and compressor.sparse:
        raise ValueError(f"algorithm {algorithm!r} needs a dense compressor, got sparse {compressor!r}: "
                         f"use one of {SPARSE_ALGORITHMS} for TopK / Threshold")
    if algorithm in SPARSE_ALGORITHMS and not compressor.sparse:
        raise ValueError(f"algorithm {algorithm!r} is for sparse compressors (TopK, Threshold), got dense "
                         f"{compressor!r}: use one of {DENSE_ALGORITHMS}")
    if algorithm in DENSE_ALGORITHMS and compressor.wire_nbytes((1,), torch.float32) is None:
        raise ValueError(f"algorithm {algorithm!r} needs a compressor with a fixed wire size "
                         f"(wire_nbytes not None), got {compressor!r}")
    if algorithm == "sparse_reduce_scatter" and (
            not isinstance(compressor, TopK) or compressor.ratio is None or not compressor.exact):
        raise ValueError("algorithm 'sparse_reduce_scatter' needs an exact TopK with a ratio "
                         f"(e.g. gc.TopK(ratio=0.01)): the density applies per region and payload sizes "
                         f"must be fixed; got {compressor!r}")
