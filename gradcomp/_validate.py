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
    if x.layout != torch.strided or x.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got "
                        + ("a nested tensor" if x.is_nested else f"layout {x.layout}"))
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {x.dtype}")
    return x


def data_tensor(name: str, x, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    """:func:`tensor`, and one that holds data (not a meta tensor)."""
    tensor(name, x, dtypes)
    if x.is_meta:
        raise ValueError(f"{name} must hold data, got a meta tensor")
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


def flag(name: str, v) -> bool:
    """``v`` itself when it is True or False, else TypeError naming ``name``."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be True or False, got {type(v).__name__}")
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


#: largest accepted timeout in seconds (about 31 years): gloo's deadline
#: arithmetic overflows for much larger ones (a wait then never ends or fails at once)
MAX_TIMEOUT = 1e9


def timeout(name: str, v) -> float:
    """A finite number of seconds in (0, MAX_TIMEOUT]."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(v).__name__}")
    v = float(v)
    if not 0 < v <= MAX_TIMEOUT:
        raise ValueError(f"{name} must be > 0 and <= {MAX_TIMEOUT:g} seconds (finite), got {v!r}")
    return v


def backend(v) -> str | None:
    """None or a known kernel backend name (whether it can run is checked on use)."""
    from gradcomp.kernels.registry import BACKENDS

    if v is not None and (not isinstance(v, str) or v not in BACKENDS):
        raise ValueError(f"backend must be None or one of {sorted(BACKENDS)}, got {v!r}")
    return v


def rounding(v) -> str:
    if v not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {v!r}")
    return v


def writable_dir(name: str, path: str) -> str:
    """Create directory ``path`` if needed and check that a file can be written
    there (a probe, removed again); returns ``path``.

    Raises:
        ValueError: ``path`` is a file, or cannot be created or written (one
            line naming ``name`` and the reason).
    """
    import os

    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{name} {path} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".gradcomp-write-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{name} {path} cannot be written: {e.strerror or e}") from None
    return path


def choice(name: str, v, allowed) -> str:
    if v not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {v!r}")
    return v


def key(v):
    """``v`` when it can key a dict (it names a tensor across calls), else TypeError."""
    try:
        hash(v)
    except TypeError:
        raise TypeError(f"key must be hashable (it names the tensor across calls), "
                        f"got {type(v).__name__}") from None
    return v


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or Inf: exactly ``torch.isfinite(t).all()``,
    in one read-only pass. A sum is finite when every element is (a NaN or an
    Inf makes it NaN or Inf); only a sum that overflowed from finite elements
    takes the exact element-wise check."""
    if bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())
