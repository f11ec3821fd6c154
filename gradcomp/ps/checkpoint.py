"""Atomic server checkpoints: parameters, optimizer state and version."""

from __future__ import annotations

import os

import torch

__all__ = ["FORMAT", "checkpoint_path", "save_atomic", "load"]

FORMAT = "gradcomp.ps/1"


def checkpoint_path(directory: str, server_index: int) -> str:
    """``<directory>/ps-server-<server_index>.pt``."""
    return os.path.join(directory, f"ps-server-{server_index}.pt")


def save_atomic(state: dict, path: str) -> None:
    """``torch.save`` to a temporary file in the same directory, flush it to
    disk, then rename it over ``path``: a reader sees the old or the new
    checkpoint, never a torn one, even if the process dies mid-write."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load(path: str) -> dict:
    """Load a checkpoint written by :func:`save_atomic` (tensors on CPU; only
    tensors and plain containers are unpickled).

    Raises:
        ValueError: the file is not a gradcomp parameter-server checkpoint.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a gradcomp parameter-server checkpoint (format {FORMAT!r})")
    return state
