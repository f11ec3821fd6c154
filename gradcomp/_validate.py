"""Argument checks shared by the public entry points (clear errors, named arguments)."""

from __future__ import annotations

import numbers

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MIN_BLOCK, MAX_BLOCK = 32, 65536
ROUNDINGS = ("nearest", "stochastic")


def tensor(name: str, x, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {x.dtype}")
    return x


def integer(name: str, v, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    v = int(v)
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def real(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    return float(v)


def block_size(v) -> int:
    v = integer("block_size", v)
    if v < MIN_BLOCK or v > MAX_BLOCK or v & (v - 1):
        raise ValueError(
            f"block_size must be a power of two from {MIN_BLOCK} to {MAX_BLOCK}, got {v}"
        )
    return v


def rounding(v) -> str:
    if v not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {v!r}")
    return v


def choice(name: str, v, allowed) -> str:
    if v not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {v!r}")
    return v
