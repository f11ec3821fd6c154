"""PowerSGD: low-rank gradient compression (one power iteration per step) on gradcomp's collectives.

Per parameter viewed as a matrix ``M`` (``rows = shape[0]``, ``cols = numel / rows``), with
error feedback ``M = g + e`` and a warm-started ``Q`` (``cols x r``, orthonormal columns):
``P = M Q``; allreduce ``P``; orthonormalize ``P``; ``Q = M^T P``; allreduce ``Q``; the
update is ``P Q^T`` (Vogels, Karimireddy and Jaggi 2019, Algorithms 1 and 2). Vectors and
matrices whose compression rate ``rows cols / ((rows + cols) r)`` is under
``min_compression_rate`` ride uncompressed in the P exchange: two collectives per call
where PyTorch's ``powerSGD_hook`` waits on three, both through gradcomp's allreduce with a
gradcomp codec (FP16 by default: half of the float32 bytes).

Invariant: every rank orthonormalizes the same decoded ``P`` and applies the same decoded
``Q``, so the result is bit-identical on every rank; a rank's residual is what its own
matrix loses to the projection, ``M - P Q_local^T``, so with an exact codec the sum over
ranks of the update and the residuals is the sum of their inputs. Docs: docs/powersgd.md.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp.comm import DEFAULT_TIMEOUT, FLAT_DENSE_ALGORITHMS, allreduce, check_algorithm, native
from gradcomp.comm._args import member_group
from gradcomp.comm.policy import CodecPolicy
from gradcomp.comm.settings import compressor_text
from gradcomp.compressors import FP16, Compressor, NoCompression, unwrapped

__all__ = ["PowerSGD", "Segment", "orthonormalize"]


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


def orthonormalize(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``x``'s (``n x r``, ``r <= n``, float32): the reduced Q
    of a Householder QR, which, unlike Gram-Schmidt without an epsilon, gives no NaN for a
    zero column (a vanishing gradient)."""
    return torch.linalg.qr(x, mode="reduced").Q


@dataclass(frozen=True)
class _Matrix:
    seg: Segment
    rows: int
    cols: int
    rank: int


class PowerSGD(CodecPolicy):
    """Rank-``r`` PowerSGD with error feedback and warm start (Vogels et al. 2019).

    Use it as ``GradCompState(compressor=gc.PowerSGD(rank=4))`` (the DDP hook: one call per
    bucket, parameters from the bucket), ``gc.LocalSGD(model, H, compressor=gc.PowerSGD(...))``
    (one call per fragment of pseudo-gradients) or ``gc.allreduce(tensor, gc.PowerSGD(...),
    key=...)`` (the tensor is one parameter: a matrix of ``shape[0]`` rows when it has two or
    more dimensions, else a vector sent whole; :meth:`reduce_` reduces several at once). One
    instance per state, LocalSGD or group of keys: it holds each matrix's warm-start ``Q``.

    Args:
        rank: the approximation rank ``r`` (>= 1; a matrix uses ``min(r, rows, cols)``).
        warm_start: start each step's power iteration from the last step's ``Q`` (the
            paper's reuse); False: a fresh random ``Q`` every step.
        min_compression_rate: a matrix is compressed when ``rows cols`` is more than this
            many times ``(rows + cols) r`` (> 0); the others ride uncompressed with ``P``.
        start_iter: calls (per key for the collective; steps for the DDP hook, whose own
            ``start_iter`` also holds; syncs for LocalSGD) reduced exactly before the
            first compressed one.
        compressor: the dense gradcomp codec of both exchanges, on gradcomp's ``algorithm``
            (default ``gc.FP16()``; ``gc.NoCompression()``: float32, exact, on the
            backend's own allreduce). ``P``'s rounding only tilts the
            subspace it spans (every rank orthonormalizes the same decoded ``P``); the
            rounding of ``Q`` reaches the update and is not remembered.
        seed: seed of the random initial ``Q`` (drawn per key from ``(seed, key, step)``,
            the same on every rank).
        error_feedback: the collective keeps a residual per key when no ``residual`` is
            given (the DDP state and LocalSGD follow their own ``error_feedback``).

    Raises:
        TypeError / ValueError: a bad argument (named in the message).
    """

    def __init__(self, rank: int = 4, *, warm_start: bool = True, min_compression_rate: float = 2.0,
                 start_iter: int = 0, compressor: Compressor | None = None, seed: int = 0,
                 error_feedback: bool = True):
        self.rank = v.integer("rank", rank, 1)
        self.warm_start = v.flag("warm_start", warm_start)
        self.min_compression_rate = v.real("min_compression_rate", min_compression_rate)
        if not (0 < self.min_compression_rate < float("inf")):
            raise ValueError(f"min_compression_rate must be a finite number > 0, got {min_compression_rate!r}")
        self.start_iter = v.integer("start_iter", start_iter, 0)
        compressor = FP16() if compressor is None else compressor
        self.compressor = unwrapped(compressor, "compressor", "PowerSGD keeps the residuals itself")
        check_algorithm("ring", self.compressor)  # dense, with a fixed wire size
        self.seed = v.integer("seed", seed)
        self.error_feedback = v.flag("error_feedback", error_feedback)
        #: matrix key -> its last ``Q`` (cols x r, float32): the warm start
        self.q: dict[Hashable, torch.Tensor] = {}
        #: key -> flat float32 residual of the collective's calls without ``residual``
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self._calls: dict[Hashable, int] = {}  # collective key -> calls so far
        self._checked: set[int] = set()  # ids of the groups whose ranks agreed on the first call

    lossy = True  # the projection drops what lies outside the rank-r subspace

    def settings(self) -> dict:
        return {"rank": self.rank, "warm_start": self.warm_start, "min_compression_rate": self.min_compression_rate,
                "start_iter": self.start_iter, "compressor": compressor_text(self.compressor), "seed": self.seed}

    def matrix(self, shape: Sequence[int]) -> tuple[int, int, int] | None:
        """``(rows, cols, rank)`` of a parameter of ``shape`` if PowerSGD compresses it, else
        None (a vector, or a compression rate under :attr:`min_compression_rate`)."""
        if len(shape) < 2 or 0 in shape:
            return None
        rows = int(shape[0])
        cols = 1
        for d in shape[1:]:
            cols *= int(d)
        r = min(self.rank, rows, cols)
        return (rows, cols, r) if rows * cols > self.min_compression_rate * (rows + cols) * r else None

    def wire_numel(self, shapes: Sequence[Sequence[int]]) -> tuple[int, int]:
        """Elements of the two exchanges for parameters of ``shapes``: ``(P's and the
        uncompressed parameters', Q's)``."""
        first = second = 0
        for shape in shapes:
            m = self.matrix(shape)
            if m is None:
                first += Segment(None, 0, tuple(shape)).numel
            else:
                first, second = first + m[0] * m[2], second + m[1] * m[2]
        return first, second

    # ---- the algorithm --------------------------------------------------------------
    def reduce_(self, buf: torch.Tensor, segments: Sequence[Segment], *, step: int,
                residual: torch.Tensor | None = None, group=None, meter=None, timeout: float = DEFAULT_TIMEOUT,
                algorithm: str = "ring", check: bool = True, tag=None) -> torch.Tensor:
        """Average ``buf`` over ``group`` in place with PowerSGD (see the module docstring).

        Every rank must call it with the same segments, step and settings, in the same order.

        Args:
            buf: flat contiguous float32 / float16 / bfloat16 tensor holding the segments.
            segments: the parameters in ``buf`` (disjoint; elements outside them are averaged
                exactly, as vectors).
            step: the caller's step count (the same on every rank): exact before
                :attr:`start_iter`; seeds a fresh ``Q``.
            residual: optional flat float32 error-feedback memory laid out like ``buf``,
                updated in place (None: no error feedback).
            group, meter, timeout, algorithm, check, tag: as :func:`gradcomp.allreduce`
                (``algorithm``: ``"ring"``, ``"two_phase"`` or ``"halving_doubling"``).

        Returns:
            ``buf``, holding the average (bit-identical on every rank).

        Raises:
            ValueError: overlapping or out-of-range segments, a bad ``residual``; as
                :func:`gradcomp.allreduce`.
        """
        v.choice("algorithm", algorithm, FLAT_DENSE_ALGORITHMS + ("halving_doubling",))
        if not isinstance(buf, torch.Tensor) or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError("buf must be a flat contiguous tensor (float32, float16 or bfloat16)")
        work = buf if buf.dtype == torch.float32 else buf.to(torch.float32)
        mats, rest = self._split(work.numel(), segments)
        if residual is not None and (residual.dtype != torch.float32 or residual.numel() != work.numel()):
            raise ValueError(f"residual must be a float32 tensor of {work.numel()} elements, got "
                             f"{residual.dtype} of {residual.numel()}")
        comm = {"group": group, "meter": meter, "timeout": timeout, "algorithm": algorithm, "tag": tag}
        if step < self.start_iter or dist.get_world_size(group) == 1:
            if residual is not None:  # delivered exactly: nothing left to remember
                work.add_(residual)
                residual.zero_()
            self._exchange(work, None, check, comm, exact=True)
        else:
            self._power_step(work, mats, rest, residual, step, check, comm)
        if work is not buf:
            buf.copy_(work)
        return buf

    def _split(self, n: int, segments) -> tuple[list[_Matrix], list[tuple[int, int]]]:
        """The compressed matrices, and the ``[lo, hi)`` ranges sent whole (everything else)."""
        for seg in segments:
            if not isinstance(seg, Segment):
                raise TypeError(f"segments must hold gradcomp.powersgd.Segment, got {type(seg).__name__}")
        mats, covered, end = [], [], 0
        for seg in sorted(segments, key=lambda s: s.offset):
            lo, hi = seg.offset, seg.offset + seg.numel
            if lo < end or hi > n:
                raise ValueError(f"segment {seg.key!r} [{lo}, {hi}) overlaps another or leaves the {n} elements")
            end = hi
            m = self.matrix(seg.shape)
            if m is not None:
                mats.append(_Matrix(seg, *m))
                covered.append((lo, hi))
        rest, at = [], 0
        for lo, hi in covered + [(n, n)]:
            if lo > at:
                rest.append((at, lo))
            at = hi
        return mats, rest

    def _power_step(self, work, mats, rest, residual, step, check, comm) -> None:
        """One compressed call: the P exchange (with the uncompressed ranges), then the Q one."""
        views = [work[m.seg.offset: m.seg.offset + m.seg.numel].view(m.rows, m.cols) for m in mats]
        if residual is not None:  # M = g + e (the whole ranges' residual goes with the codec's)
            for m in mats:
                work[m.seg.offset: m.seg.offset + m.seg.numel].add_(residual[m.seg.offset: m.seg.offset + m.seg.numel])
        qs = [self._start_q(m, step, work.device) for m in mats]
        n_p = sum(m.rows * m.rank for m in mats)
        first = torch.empty(n_p + sum(hi - lo for lo, hi in rest), dtype=torch.float32, device=work.device)
        ps, at = [], 0
        for m, M, q in zip(mats, views, qs):
            ps.append(torch.mm(M, q, out=first[at: at + m.rows * m.rank].view(m.rows, m.rank)))
            at += m.rows * m.rank
        res1 = None
        if residual is not None:  # the codec's error feedback for the ranges sent whole; P needs none
            res1 = torch.zeros_like(first)
        for lo, hi in rest:
            first[at: at + hi - lo].copy_(work[lo:hi])
            if res1 is not None:
                res1[at: at + hi - lo].copy_(residual[lo:hi])
            at += hi - lo
        self._exchange(first, res1, check, comm)
        second = torch.empty(sum(m.cols * m.rank for m in mats), dtype=torch.float32, device=work.device)
        at = 0
        for i, (m, M) in enumerate(zip(mats, views)):
            ps[i] = orthonormalize(ps[i])  # the same decoded P on every rank: the same basis
            q_local = torch.mm(M.t(), ps[i], out=second[at: at + m.cols * m.rank].view(m.cols, m.rank))
            if residual is not None:  # what this rank's matrix loses to the projection
                e = residual[m.seg.offset: m.seg.offset + m.seg.numel].view(m.rows, m.cols)
                torch.addmm(M, ps[i], q_local.t(), beta=1.0, alpha=-1.0, out=e)
            at += m.cols * m.rank
        if mats:
            self._exchange(second, None, check, comm)
        at = 0
        for i, (m, M) in enumerate(zip(mats, views)):
            q = second[at: at + m.cols * m.rank].view(m.cols, m.rank)
            torch.mm(ps[i], q.t(), out=M)
            if self.warm_start:
                self.q[m.seg.key] = q.clone()
            at += m.cols * m.rank
        at = n_p
        for lo, hi in rest:
            work[lo:hi].copy_(first[at: at + hi - lo])
            if residual is not None:
                residual[lo:hi].copy_(res1[at: at + hi - lo])
            at += hi - lo

    def _exchange(self, buf, residual, check, comm, exact=False) -> None:
        """Average ``buf`` in place: float32 (``exact``, or a NoCompression codec) on the
        backend's allreduce, which gradcomp's ring cannot beat for raw bytes (as
        :class:`gradcomp.Adaptive` runs ``none``), else the codec on gradcomp's ``algorithm``."""
        if exact or type(self.compressor) is NoCompression:
            native.allreduce(buf, op="avg", group=comm["group"], meter=comm["meter"], timeout=comm["timeout"],
                             residual=residual, out=buf, check=check, tag=comm["tag"])
        else:
            allreduce(buf, self.compressor, op="avg", residual=residual, out=buf, check=check, **comm)

    def _start_q(self, m: _Matrix, step: int, device) -> torch.Tensor:
        """The orthonormal ``Q`` this call starts from: the warm start's, else a fresh
        standard-normal one drawn from ``(seed, key, step)`` (the same on every rank)."""
        q = self.q.get(m.seg.key) if self.warm_start else None
        if q is None or q.shape != (m.cols, m.rank):
            seed = zlib.crc32(repr((self.seed, m.seg.key, step)).encode())  # not hash(): salted per process
            q = torch.randn(m.cols, m.rank, generator=torch.Generator().manual_seed(seed))
        return orthonormalize(q.to(device=device, dtype=torch.float32))

    # ---- gradcomp.allreduce ------------------------------------------------------------
    def allreduce(self, tensor, *, op, algorithm, group, meter, timeout, key, residual, out, check, tag=None):
        """:func:`gradcomp.allreduce` with this policy: ``tensor`` is one parameter (see the
        class docstring); ``key`` names its warm start and residual (default: its shape),
        the call count per key decides :attr:`start_iter`; ``op`` ``"avg"`` or ``"sum"``."""
        v.choice("op", op, ("avg", "sum"))
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(f"tensor must be a floating-point torch.Tensor, got {type(tensor).__name__}")
        key = ("shape", tuple(tensor.shape)) if key is None else key
        v.timeout("timeout", timeout)
        group = member_group(group, "gradcomp.allreduce")
        self.agree(group, timeout=timeout, device=tensor.device, meter=meter)
        work = tensor.detach().reshape(-1).to(torch.float32, copy=True)
        if residual is None and self.error_feedback:
            residual = self.residuals.get(key)
            if residual is None or residual.numel() != work.numel():
                residual = self.residuals[key] = torch.zeros_like(work)
        step = self._calls.get(key, 0)
        self._calls[key] = step + 1
        gid = id(group)
        self.reduce_(work, [Segment(key, 0, tuple(tensor.shape))], step=step, residual=residual, group=group,
                     meter=meter, timeout=timeout, algorithm=algorithm, check=check and gid not in self._checked,
                     tag=tag)
        self._checked.add(gid)
        if op == "sum":
            work.mul_(dist.get_world_size(group))
        if out is None:
            return work.to(tensor.dtype).view(tensor.shape)
        return out.copy_(work.view(out.shape))

    def state_dict(self) -> dict:
        """The warm-start ``Q`` of every matrix (on CPU) and the collective's call counts;
        the residuals stay with their owner (the DDP state, LocalSGD, :attr:`residuals`)."""
        return {"q": {k: q.detach().cpu().clone() for k, q in self.q.items()}, "calls": dict(self._calls),
                "residuals": {k: r.detach().cpu().clone() for k, r in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (an empty mapping restores nothing).

        Raises:
            ValueError: a ``q`` that is not a mapping of 2-D float32 tensors.
        """
        q = state.get("q", {})
        if not isinstance(q, dict) or any(not isinstance(t, torch.Tensor) or t.dim() != 2
                                          or t.dtype != torch.float32 for t in q.values()):
            raise ValueError("state['q'] must map keys to 2-D float32 tensors (cols x rank)")
        self.q = {k: t.clone() for k, t in q.items()}
        self._calls = dict(state.get("calls", {}))
        self.residuals = {k: r.clone() for k, r in state.get("residuals", {}).items()}

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_checked"] = set()  # group ids mean nothing in another process
        return d

    def __repr__(self) -> str:
        return (f"PowerSGD(rank={self.rank}, warm_start={self.warm_start}, "
                f"min_compression_rate={self.min_compression_rate:g}, start_iter={self.start_iter}, "
                f"compressor={self.compressor!r})")
