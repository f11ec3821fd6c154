"""Argument checks and the flattening the compressors share (public names in a private module)."""

from __future__ import annotations

import torch

from gradcomp import wire as W

__all__ = ["flat", "check_acc", "check_no_grad", "check_wire_out"]


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 1-D view (a contiguous copy first when it is not contiguous)."""
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)


def check_acc(acc: torch.Tensor, p: W.Payload) -> None:
    """Check the accumulator of ``decompress_add_``: a contiguous float32 tensor with the
    payload's number of elements on its device, not recorded by autograd.

    Raises:
        TypeError / ValueError: naming what ``acc`` must be.
    """
    if not isinstance(acc, torch.Tensor):
        raise TypeError(f"acc must be a torch.Tensor, got {type(acc).__name__}")
    if acc.dtype != torch.float32 or not acc.is_contiguous():
        raise ValueError(f"acc must be a contiguous float32 tensor, got "
                         f"{'a non-contiguous ' if not acc.is_contiguous() else ''}{acc.dtype}")
    if acc.numel() != p.numel:
        raise ValueError(f"acc must have {p.numel} elements (the payload's), got {acc.numel()}")
    if acc.device != p.device:
        raise ValueError(f"acc must be on the payload's device {p.device}, got {acc.device}")
    check_no_grad("acc", acc)


def check_no_grad(name: str, t: torch.Tensor) -> None:
    """Decoding writes ``t`` in place outside autograd (kernels write the memory),
    so a tensor that autograd records is refused, as torch refuses ``out=`` then."""
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} must not require grad while autograd is recording (decoding is not "
                         f"differentiable): pass {name}.detach() or decode under torch.no_grad()")


def check_wire_out(c, out, t: torch.Tensor) -> None:
    """Check ``out=`` of ``c.compress(t, out=out)``: a dense compressor (a
    :class:`~gradcomp.Compressor`) and a 1-D uint8 tensor of exactly the wire size on ``t``'s device.

    Raises:
        ValueError: naming what ``out`` must be.
    """
    if c.sparse:
        raise ValueError(f"out= needs a dense compressor (fixed wire size), got {c!r}")
    want = c.wire_nbytes(t.shape, t.dtype)
    if want is None:
        raise ValueError(f"out= needs a compressor with a fixed wire size, got {c!r}")
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1
            or not out.is_contiguous() or out.numel() != want or out.device != t.device):
        got = (f"{out.dtype} tensor of shape {tuple(out.shape)} on {out.device}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(f"out must be a contiguous 1-D uint8 tensor of {want} bytes (the wire size) "
                         f"on {t.device}, got {got}")
