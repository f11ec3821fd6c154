"""Flat float32 residuals of one call, each parameter's part a view kept under its own key.

FSDP2 hands a communication hook one flat buffer per module holding every
parameter's part side by side; error feedback keeps one residual per
parameter (keyed by name, shape, mesh sizes and rank, docs/fsdp2.md) so a
parameter without a gradient, another mesh or another rank's checkpoint never
applies one shard's residual to another. :func:`flat_residual` builds the
flat residual a call adds and updates, with each key's tensor a view into it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["flat_residual"]


def flat_residual(residuals: dict, flats: dict, slot: Hashable, layout: Sequence[tuple[tuple, int, int]], n: int,
                  rows: int, device, per_param: bool = True) -> torch.Tensor:
    """The flat float32 residual of ``n`` elements for one call, laid out as ``layout`` says.

    The buffer is seen as ``[rows, n / rows]``; with ``per_param`` the key of
    ``(key, lo, hi)`` holds the view of its columns ``[lo, hi)`` (shape
    ``[rows, hi - lo]``), else each key holds the flat tensor itself. A key's
    old tensor with the same number of elements is copied in; the buffer is
    reused as is while the layout stays the same (kept in ``flats[slot]``).

    Args:
        residuals: key -> float32 tensor (updated: keys of ``layout`` now hold the views).
        flats: slot -> ``(keys, flat)``, the cache of built buffers (updated).
        slot: what tells one caller's buffer from another's (e.g. the module).
        layout: ``(key, lo, hi)`` per parameter, columns ``[lo, hi)``.
        n: elements of the buffer, a multiple of ``rows``. rows: see above.
        device: the buffer's device.

    Returns:
        float32 ``[n]`` on ``device``.
    """
    keys = tuple(k for k, _, _ in layout)
    held = flats.get(slot)
    if held is not None and held[0] == keys and all(
            residuals.get(k) is held[1] or getattr(residuals.get(k), "_base", None) is held[1] for k in keys):
        return held[1]
    flat = torch.zeros(n, dtype=torch.float32, device=device)
    grid = flat.view(rows, n // rows)
    for k, lo, hi in layout:
        view = grid[:, lo:hi] if per_param else flat
        old = residuals.get(k)
        if old is not None and old.numel() == view.numel():
            view.copy_(old.view(view.shape))
        residuals[k] = view
    flats[slot] = (keys, flat)
    return flat
