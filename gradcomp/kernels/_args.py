"""Argument checks and views the public kernel functions share (public names in a private module)."""

from __future__ import annotations

import torch

from gradcomp import _validate as v
from gradcomp.kernels.reference import stream_key

__all__ = ["flat_contiguous", "nblocks", "check_out", "stream_args", "check_rounding_stream"]


def flat_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous 1-D tensor (x itself when it is one: no new view per call)."""
    if x.is_contiguous():
        return x if x.dim() == 1 else x.view(-1)
    return x.contiguous().view(-1)


def nblocks(n: int, block_size: int) -> int:
    """Blocks of ``block_size`` elements covering ``n`` elements: ``ceil(n / block_size)``."""
    return -(-n // block_size)


def check_out(name, out, numel, dtype, device):
    """``out`` as a flat view when it is a contiguous ``dtype`` tensor of ``numel`` elements on
    ``device`` (None stays None).

    Raises:
        TypeError / ValueError: naming ``name`` and what it must be.
    """
    if out is None:
        return None
    v.tensor(name, out, None)
    if out.dtype != dtype or out.numel() != numel or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {dtype} tensor of {numel} elements on {device}, "
            f"got {out.dtype} with {out.numel()} elements on {out.device}"
        )
    return out if out.dim() == 1 else out.view(-1)


def stream_args(rounding: str, seed: int, counter: int) -> tuple[bool, int]:
    """The ``(stochastic, key)`` arguments of the quantizing ops."""
    stochastic = rounding == "stochastic"
    return stochastic, stream_key(seed, counter) if stochastic else 0


def check_rounding_stream(rounding, seed, counter) -> tuple[bool, int]:
    """Validate ``rounding``, ``seed`` and ``counter``; return :func:`stream_args` of them.

    Raises:
        ValueError / TypeError: naming the argument and its allowed values.
    """
    rounding = v.rounding(rounding)
    return stream_args(rounding, v.integer("seed", seed), v.integer("counter", counter))
