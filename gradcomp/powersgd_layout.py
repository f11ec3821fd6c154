"""The plan of one PowerSGD call: which parameters are matrices, where their factors lie.

A call's parameters are segments (:class:`Segment`) of one flat buffer; :class:`FactorLayout` orders the
compressed ones by shape (one batched orthonormalization per shape) and preallocates the
exchanges' flat buffers, so a step allocates nothing. Used by :mod:`gradcomp.powersgd`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

__all__ = ["Segment", "Matrix", "FactorLayout"]


@dataclass(frozen=True)
class Segment:
    """One parameter's place in a flat buffer: its key (names its warm-start ``Q``), the
    offset of its first element and its shape (elements, contiguous in the buffer)."""

    key: Hashable
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Matrix:
    """A parameter PowerSGD compresses: its segment and its ``rows x cols`` view's rank."""

    seg: Segment
    rows: int
    cols: int
    rank: int


class FactorLayout:
    """One call layout's plan and buffers: the compressed matrices ordered by shape (one
    batched orthonormalization per group of equal shapes), the ranges sent whole, and the
    exchanges' preallocated float32 buffers (0: P's then the ranges; 1: Q's; 2, the alternating
    scheme's: Q's then the ranges) and float16 twins."""

    def __init__(self, key, mats: list[Matrix], rest: list[tuple[int, int]], device):
        self.key = key  # (segments, numel): names the exchanges' FP16 exponents
        self.mats = sorted(mats, key=lambda m: (m.rows, m.cols, m.rank, m.seg.offset))
        self.rest = rest
        self.groups: list[tuple[int, int]] = []  # (first matrix, count) of equal shapes
        self.p_at, self.q_at, n_p, n_q = [], [], 0, 0
        prev = None
        for i, m in enumerate(self.mats):
            shape = (m.rows, m.cols, m.rank)
            if shape == prev:
                self.groups[-1] = (self.groups[-1][0], self.groups[-1][1] + 1)
            else:
                self.groups.append((i, 1))
            prev = shape
            self.p_at.append(n_p)
            self.q_at.append(n_q)
            n_p, n_q = n_p + m.rows * m.rank, n_q + m.cols * m.rank
        self.n_p, self.n_q = n_p, n_q
        n_rest = sum(hi - lo for lo, hi in rest)
        self.first = torch.empty(n_p + n_rest, dtype=torch.float32, device=device)
        self.second = torch.empty(n_q, dtype=torch.float32, device=device)
        self._q_rest: torch.Tensor | None = None  # buffer 2: made on first use
        self.loss = torch.empty(n_rest, dtype=torch.float32, device=device)
        self._half: list[torch.Tensor | None] = [None, None, None]
        self._codec_residual: list[torch.Tensor | None] = [None, None, None]

    def p(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Matrix ``i``'s ``P`` (rows x r) in ``buf``."""
        m = self.mats[i]
        return buf[self.p_at[i]: self.p_at[i] + m.rows * m.rank].view(m.rows, m.rank)

    def q(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Matrix ``i``'s ``Q`` (cols x r) in ``buf``."""
        m = self.mats[i]
        return buf[self.q_at[i]: self.q_at[i] + m.cols * m.rank].view(m.cols, m.rank)

    def buffer(self, which: int) -> torch.Tensor:
        """Exchange ``which``'s float32 buffer (see the class docstring)."""
        if which == 2 and self._q_rest is None:
            self._q_rest = torch.empty(self.n_q + self.loss.numel(), dtype=torch.float32, device=self.first.device)
        return (self.first, self.second, self._q_rest)[which]

    def rest_at(self, which: int) -> int | None:
        """Where exchange ``which``'s buffer holds the ranges sent whole, or None."""
        return (self.n_p, None, self.n_q)[which]

    def half(self, which: int) -> torch.Tensor:
        """The float16 twin of exchange ``which``'s buffer."""
        if self._half[which] is None:
            self._half[which] = torch.empty_like(self.buffer(which), dtype=torch.float16)
        return self._half[which]

    def codec_residual(self, which: int) -> torch.Tensor:
        """A zeroed float32 residual for a gradcomp codec's exchange ``which``."""
        if self._codec_residual[which] is None:
            self._codec_residual[which] = torch.empty_like(self.buffer(which))
        return self._codec_residual[which].zero_()
