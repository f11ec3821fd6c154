"""PowerSGD: low-rank gradient compression (one power iteration per step) on gradcomp's collectives.

Per parameter viewed as a matrix ``M`` (``rows = shape[0]``, ``cols = numel / rows``), with
error feedback ``M = g + e`` and a warm-started ``Q`` (``cols x r``, orthonormal columns):
``P = M Q``; allreduce ``P``; orthonormalize ``P``; ``Q = M^T P``; allreduce ``Q``; the update
is ``P Q^T`` (Vogels, Karimireddy and Jaggi 2019, Algorithms 1 and 2). Vectors and matrices
whose compression rate ``rows cols / ((rows + cols) r)`` is under ``min_compression_rate``
ride uncompressed in the P exchange: two collectives per call where PyTorch's
``powerSGD_hook`` waits on three (``alternating=True``: one, half a power iteration per call:
PowerGossip's scheme, Vogels et al. 2020), each one flat buffer: FP16 by default (half of the
float32 bytes), summed in float16 by the backend's allreduce under a power-of-two scale every
rank derives from the exchange's last sum, or a gradcomp codec on gradcomp's allreduce.

Invariant: every rank orthonormalizes the same decoded ``P`` and applies the same decoded
``Q``, so the result is bit-identical on every rank; a rank's residual is what its own
matrix loses to the projection, ``M - P Q_local^T``, so with an exact codec the sum over
ranks of the update and the residuals is the sum of their inputs. Docs: docs/powersgd.md.
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp.comm import DEFAULT_TIMEOUT, FLAT_DENSE_ALGORITHMS, allreduce, check_algorithm, native
from gradcomp.comm._args import member_group
from gradcomp.comm.guard import exclusive
from gradcomp.comm.policy import CodecPolicy
from gradcomp.comm.settings import compressor_text
from gradcomp.compressors import FP16, Compressor, NoCompression, unwrapped
from gradcomp.powersgd_layout import FactorLayout, Matrix, Segment

__all__ = ["PowerSGD", "Segment", "orthonormalize"]


def orthonormalize(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``x``'s (``n x r``, ``r <= n``, float32): the reduced Q
    of a Householder QR, which, unlike Gram-Schmidt without an epsilon, gives no NaN for a
    zero column (a vanishing gradient)."""
    return torch.linalg.qr(x, mode="reduced").Q


#: where the FP16 factors' exponent puts the absolute maximum of the last sum: 2^6 of headroom
#: below float16's largest value (65504) for sums that grow between calls, and 24 binades of
#: full precision below it
_SUM_TARGET_LOG2 = 10


def _next_exponent(avg: torch.Tensor, world: int) -> int | None:
    """The power of two that puts ``world`` times ``avg``'s absolute maximum at
    ``2**_SUM_TARGET_LOG2``, or None (float32 next) for an all-zero or non-finite ``avg``."""
    if avg.numel() == 0:
        return None
    mn, mx = torch.aminmax(avg)
    amax = max(abs(float(mn)), abs(float(mx)))
    if not math.isfinite(amax) or amax == 0.0:
        return None
    return min(max(_SUM_TARGET_LOG2 - math.ceil(math.log2(amax * world)), -100), 100)  # 2^e stays normal


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
        compressor: the dense gradcomp codec of both exchanges (default ``gc.FP16()``;
            ``gc.NoCompression()``: float32, exact). ``P``'s rounding only tilts the
            subspace it spans (every rank orthonormalizes the same decoded ``P``); the
            rounding of ``Q`` reaches the update and is not remembered.
        exchange: who sums the factors: ``"backend"`` (``gc.FP16()`` or
            ``gc.NoCompression()`` only): one ``dist.all_reduce`` per exchange on a flat
            float16 (or float32) buffer, summed in that dtype by the backend (gloo on CPU,
            NCCL), scaled by a power of two that every rank derives from the exchange's
            last sum (float32 on the first call, after an all-zero sum, and again when the
            float16 sum overflows); ``"gradcomp"``: the codec on gradcomp's ``algorithm``
            (any dense codec); ``"auto"`` (default): ``"backend"`` where it applies.
        seed: seed of the random initial ``Q`` (drawn per key from ``(seed, key, step)``,
            the same on every rank).
        error_feedback: the collective keeps a residual per key when no ``residual`` is
            given (the DDP state and LocalSGD follow their own ``error_feedback``).
        alternating: one collective per call: half a power iteration, the factor sent
            alternating (PowerGossip's scheme, Vogels et al. 2020): ``P = M Q`` on the last
            call's orthonormal ``Q``, then ``Q = M^T P`` on the kept basis of that ``P``, the
            uncompressed parameters riding with either; each update projects the average on
            a basis one call old (half the rounds and factor bytes). Needs ``warm_start``;
            loses accuracy where the gradient's subspace moves fast (docs/powersgd.md).
        alternate_after: with ``alternating``: compressed calls of the full iteration (the
            paper's, two collectives) before the first alternating one (>= 0), counted like
            ``start_iter`` from it: the fast-moving first steps find their basis.

    Raises:
        TypeError / ValueError: a bad argument (named in the message).
    """

    def __init__(self, rank: int = 4, *, warm_start: bool = True, min_compression_rate: float = 2.0,
                 start_iter: int = 0, compressor: Compressor | None = None, exchange: str = "auto",
                 seed: int = 0, error_feedback: bool = True, alternating: bool = False, alternate_after: int = 0):
        self.rank = v.integer("rank", rank, 1)
        self.warm_start = v.flag("warm_start", warm_start)
        self.min_compression_rate = v.real("min_compression_rate", min_compression_rate)
        if not (0 < self.min_compression_rate < float("inf")):
            raise ValueError(f"min_compression_rate must be a finite number > 0, got {min_compression_rate!r}")
        self.start_iter = v.integer("start_iter", start_iter, 0)
        compressor = FP16() if compressor is None else compressor
        self.compressor = unwrapped(compressor, "compressor", "PowerSGD keeps the residuals itself")
        check_algorithm("ring", self.compressor)  # dense, with a fixed wire size
        v.choice("exchange", exchange, ("auto", "backend", "gradcomp"))
        summable = type(self.compressor) in (FP16, NoCompression)  # dtypes a backend's allreduce sums
        if exchange == "backend" and not summable:
            raise ValueError(f"exchange='backend' sums float16 or float32 factors (compressor gc.FP16() or "
                             f"gc.NoCompression()), got compressor {compressor_text(self.compressor)}; "
                             "use exchange='gradcomp' or 'auto'")
        self.exchange = ("backend" if summable else "gradcomp") if exchange == "auto" else exchange
        self.seed = v.integer("seed", seed)
        self.error_feedback = v.flag("error_feedback", error_feedback)
        self.alternating = v.flag("alternating", alternating)
        self.alternate_after = v.integer("alternate_after", alternate_after, 0)
        if self.alternating and not self.warm_start:
            raise ValueError("alternating=True keeps each factor for the next call: it needs warm_start=True")
        #: matrix key -> its last ``Q`` (cols x r, float32): the warm start
        self.q: dict[Hashable, torch.Tensor] = {}
        #: matrix key -> the orthonormal ``P`` (rows x r) the alternating scheme's next call projects on
        self.p: dict[Hashable, torch.Tensor] = {}
        #: key -> flat float32 residual of the collective's calls without ``residual``
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self._calls: dict[Hashable, int] = {}  # collective key -> calls so far
        self._checked: set[int] = set()  # ids of the groups whose ranks agreed on the first call
        #: call layout -> the FP16 exponent of its P and Q exchanges (None: float32 next)
        self._exponents: dict[Hashable, list[int | None]] = {}
        self._layouts: dict[Hashable, FactorLayout] = {}  # (call layout, device) -> plan and buffers
        self._busy = threading.Lock()  # one call at a time: the layouts' buffers are shared

    lossy = True  # the projection drops what lies outside the rank-r subspace

    def settings(self) -> dict:
        return {"rank": self.rank, "warm_start": self.warm_start, "min_compression_rate": self.min_compression_rate,
                "start_iter": self.start_iter, "compressor": compressor_text(self.compressor), "exchange": self.exchange,
                "seed": self.seed, "alternating": self.alternating, "alternate_after": self.alternate_after}

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
                (``algorithm``: ``"ring"``, ``"two_phase"`` or ``"halving_doubling"``, used by
                ``exchange="gradcomp"`` only).

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
        lay = self._layout(work, segments)
        if residual is not None and (residual.dtype != torch.float32 or residual.numel() != work.numel()):
            raise ValueError(f"residual must be a float32 tensor of {work.numel()} elements, got "
                             f"{residual.dtype} of {residual.numel()}")
        comm = {"group": group, "meter": meter, "timeout": timeout, "algorithm": algorithm, "tag": tag}
        if not self._busy.acquire(timeout=timeout):
            raise RuntimeError(f"PowerSGD: another thread's call on this instance held it for over {timeout} s")
        try:
            self._reduce(work, lay, residual, step, check, comm)
        finally:
            self._busy.release()
        if work is not buf:
            buf.copy_(work)
        return buf

    def _reduce(self, work, lay: FactorLayout, residual, step, check, comm) -> None:
        """:meth:`reduce_` on float32 ``work``: exact before :attr:`start_iter`, else compressed."""
        group, meter, timeout, tag = comm["group"], comm["meter"], comm["timeout"], comm["tag"]
        if step < self.start_iter or dist.get_world_size(group) == 1:
            if residual is not None:  # delivered exactly: nothing left to remember
                work.add_(residual)
                residual.zero_()
            native.allreduce(work, op="avg", group=group, meter=meter, timeout=timeout, out=work, check=check,
                             tag=tag)
        elif self.alternating and step >= self.start_iter + self.alternate_after:
            self._half_step(work, lay, residual, step, check, comm)
        else:
            self._power_step(work, lay, residual, step, check, comm)

    def _layout(self, work: torch.Tensor, segments) -> FactorLayout:
        """The plan and buffers of a call on ``work`` with ``segments`` (made once per layout)."""
        try:
            key = (tuple(segments), work.numel())
            lay = self._layouts.get((key, str(work.device)))
        except TypeError:  # an unhashable entry or key
            raise TypeError("segments must hold gradcomp.powersgd.Segment with hashable keys") from None
        if lay is None:
            mats, rest = self._split(work.numel(), segments)
            lay = self._layouts[(key, str(work.device))] = FactorLayout(key, mats, rest, work.device)
        return lay

    def _split(self, n: int, segments) -> tuple[list[Matrix], list[tuple[int, int]]]:
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
                mats.append(Matrix(seg, *m))
                covered.append((lo, hi))
        rest, at = [], 0
        for lo, hi in covered + [(n, n)]:
            if lo > at:
                rest.append((at, lo))
            at = hi
        return mats, rest

    def _power_step(self, work, lay: FactorLayout, residual, step, check, comm) -> None:
        """One compressed call: the P exchange (with the uncompressed ranges), then the Q one."""
        mats, first, second = lay.mats, lay.first, lay.second
        views = [work[m.seg.offset: m.seg.offset + m.seg.numel].view(m.rows, m.cols) for m in mats]
        self._add_residual(work, mats, residual)
        for i0, k in lay.groups:  # P = M Q, from one batched orthonormalization of the group's Qs
            qs = self._start_qs(mats[i0: i0 + k], step, work.device)
            for j in range(k):
                torch.mm(views[i0 + j], qs[j], out=lay.p(first, i0 + j))
        self._pack_rest(first, lay.n_p, lay, work, residual)
        loss = self._exchange(first, lay, 0, check, comm)
        self._orthonormalize_ps(first, lay)  # the same decoded P on every rank: the same basis
        for i, M in enumerate(views):
            torch.mm(M.t(), lay.p(first, i), out=lay.q(second, i))  # this rank's Q

        def residuals():  # what this rank's matrix loses to the projection (its own Q)
            for i, (m, M) in enumerate(zip(mats, views)):
                e = residual[m.seg.offset: m.seg.offset + m.seg.numel].view(m.rows, m.cols)
                torch.addmm(M, lay.p(first, i), lay.q(second, i).t(), beta=1.0, alpha=-1.0, out=e)

        if mats:
            self._exchange(second, lay, 1, check, comm, meanwhile=residuals if residual is not None else None)
            kept = second.clone() if self.warm_start else second
        for i, (m, M) in enumerate(zip(mats, views)):
            torch.mm(lay.p(first, i), lay.q(second, i).t(), out=M)
            if self.warm_start:
                self.q[m.seg.key] = lay.q(kept, i)
        self._unpack_rest(first, lay.n_p, lay, work, residual, loss)

    def _half_step(self, work, lay: FactorLayout, residual, step, check, comm) -> None:
        """One compressed call of the alternating scheme: the P exchange on the last call's
        ``Q``, or, where every matrix keeps a ``P`` basis from the last call, the Q exchange
        on it; the uncompressed ranges ride with either."""
        mats = lay.mats
        views = [work[m.seg.offset: m.seg.offset + m.seg.numel].view(m.rows, m.cols) for m in mats]
        self._add_residual(work, mats, residual)
        sends_q = bool(mats) and all(self.p.get(m.seg.key) is not None
                                     and self.p[m.seg.key].shape == (m.rows, m.rank) for m in mats)
        which = 2 if sends_q else 0
        buf = lay.buffer(which)
        if sends_q:  # Q = M^T P on the P basis every rank kept
            bases = [self.p.pop(m.seg.key).to(device=work.device) for m in mats]
            for i, M in enumerate(views):
                torch.mm(M.t(), bases[i], out=lay.q(buf, i))
        else:  # P = M Q on the orthonormal Q of the last call (or a seeded one)
            bases = []
            for i0, k in lay.groups:
                bases.extend(self._start_qs(mats[i0: i0 + k], step, work.device).unbind(0))
            for i, M in enumerate(views):
                torch.mm(M, bases[i], out=lay.p(buf, i))
        self._pack_rest(buf, lay.rest_at(which), lay, work, residual)

        def residuals():  # what this rank's matrix loses to the projection (its own factor)
            for i, (m, M) in enumerate(zip(mats, views)):
                e = residual[m.seg.offset: m.seg.offset + m.seg.numel].view(m.rows, m.cols)
                p, q = (bases[i], lay.q(buf, i)) if sends_q else (lay.p(buf, i), bases[i])
                torch.addmm(M, p, q.t(), beta=1.0, alpha=-1.0, out=e)

        loss = self._exchange(buf, lay, which, check, comm, meanwhile=residuals if residual is not None else None)
        for i, M in enumerate(views):  # the update: the average projected on the basis
            p, q = (bases[i], lay.q(buf, i)) if sends_q else (lay.p(buf, i), bases[i])
            torch.mm(p, q.t(), out=M)
        if sends_q:  # the averaged Q: the next call's start (orthonormalized there)
            for i, m in enumerate(mats):
                self.q[m.seg.key] = lay.q(buf, i).clone()
        elif mats:  # the averaged P's orthonormal basis: the next call's
            self._orthonormalize_ps(buf, lay)
            for i, m in enumerate(mats):
                self.p[m.seg.key] = lay.p(buf, i).clone()
        self._unpack_rest(buf, lay.rest_at(which), lay, work, residual, loss)

    @staticmethod
    def _add_residual(work, mats, residual) -> None:
        """``M = g + e`` for the compressed matrices."""
        if residual is not None:
            for m in mats:
                work[m.seg.offset: m.seg.offset + m.seg.numel].add_(residual[m.seg.offset: m.seg.offset + m.seg.numel])

    @staticmethod
    def _orthonormalize_ps(buf, lay: FactorLayout) -> None:
        """Orthonormalize the P's in ``buf`` in place, one batched QR per group of equal shapes."""
        for i0, k in lay.groups:
            m = lay.mats[i0]
            block = buf[lay.p_at[i0]: lay.p_at[i0] + k * m.rows * m.rank].view(k, m.rows, m.rank)
            block.copy_(orthonormalize(block))

    @staticmethod
    def _pack_rest(buf, at: int, lay: FactorLayout, work, residual) -> None:
        """Copy the ranges sent whole (plus their residual) into ``buf`` from ``at`` on."""
        for lo, hi in lay.rest:
            buf[at: at + hi - lo].copy_(work[lo:hi])
            if residual is not None:
                buf[at: at + hi - lo].add_(residual[lo:hi])
            at += hi - lo

    @staticmethod
    def _unpack_rest(buf, at: int, lay: FactorLayout, work, residual, loss) -> None:
        """Copy the averaged ranges back to ``work``; their residual is what the wire's
        rounding took from this rank's elements (``loss``, laid out from 0; None: nothing)."""
        start = at
        for lo, hi in lay.rest:
            work[lo:hi].copy_(buf[at: at + hi - lo])
            if residual is not None:
                if loss is None:
                    residual[lo:hi].zero_()
                else:
                    residual[lo:hi].copy_(loss[at - start: at - start + hi - lo])
            at += hi - lo

    def _exchange(self, buf: torch.Tensor, lay: FactorLayout, which: int, check: bool, comm,
                  meanwhile=None) -> torch.Tensor | None:
        """Average ``buf`` (the layout's buffer ``which``, :meth:`FactorLayout.buffer`) in place;
        ``meanwhile()`` (reading ``buf``'s values before the exchange) runs while a float16
        sum is in flight, else before the exchange.

        Returns:
            What the wire's rounding took from this rank's elements past the factors (the ranges
            sent whole; for their error feedback), or None where it took nothing.
        """
        group, meter, timeout = comm["group"], comm["meter"], comm["timeout"]
        exponents = self._exponents.setdefault(lay.key, [None, None])
        exponents += [None] * (which + 1 - len(exponents))  # the alternating scheme's Q's + ranges: a third
        e = exponents[which]
        if self.exchange == "gradcomp" or e is None or type(self.compressor) is NoCompression:
            if meanwhile is not None:
                meanwhile()
            if self.exchange == "gradcomp":
                res = lay.codec_residual(which)
                allreduce(buf, self.compressor, op="avg", residual=res, out=buf, check=check, **comm)
                return None if lay.rest_at(which) is None else res[lay.rest_at(which):]
            native.allreduce(buf, op="avg", group=group, meter=meter, timeout=timeout, out=buf, check=check,
                             tag=comm["tag"])
            exponents[which] = _next_exponent(buf, dist.get_world_size(group))
            return None
        half, loss, at = lay.half(which), lay.loss, lay.rest_at(which)
        torch.mul(buf, math.ldexp(1.0, e), out=half)  # a power of two: exact before the cast, the same everywhere
        if at is not None:  # this rank's rounding of the ranges sent whole, before the sum
            loss.copy_(half[at:]).mul_(math.ldexp(1.0, -e))
            torch.sub(buf[at:], loss, out=loss)
        with exclusive(group, timeout=timeout):
            wait = native.allreduce_start(half, group=group, meter=meter)  # summed in float16
            if meanwhile is not None:
                meanwhile()
            wait(timeout)
        world = dist.get_world_size(group)
        if not bool(torch.isfinite(half).all()):  # the sum overflowed (on every rank alike): again in float32
            native.allreduce(buf, op="avg", group=group, meter=meter, timeout=timeout, out=buf, check=False,
                             tag=comm["tag"])
            exponents[which] = _next_exponent(buf, world)
            return None
        buf.copy_(half).mul_(math.ldexp(1.0, -e)).div_(world)
        exponents[which] = _next_exponent(buf, world)
        return None if at is None else loss

    def _start_qs(self, mats: Sequence[Matrix], step: int, device) -> torch.Tensor:
        """The orthonormal ``Q``s (``k x cols x r``) that matrices of one shape start from:
        the warm start's, else a fresh standard-normal one drawn from ``(seed, key, step)``
        (the same on every rank)."""
        qs = []
        for m in mats:
            q = self.q.get(m.seg.key) if self.warm_start else None
            if q is None or q.shape != (m.cols, m.rank):
                seed = zlib.crc32(repr((self.seed, m.seg.key, step)).encode())  # not hash(): salted per process
                q = torch.randn(m.cols, m.rank, generator=torch.Generator().manual_seed(seed))
            qs.append(q.to(device=device, dtype=torch.float32))
        return orthonormalize(torch.stack(qs))

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
        """The warm-start ``Q`` of every matrix (on CPU), the alternating scheme's kept ``P``
        bases, the collective's call counts and residuals, and each call layout's FP16
        exponents (a rank restored from it sends what its peers send); the DDP state's and
        LocalSGD's residuals stay with their owner."""
        return {"q": {k: q.detach().cpu().clone() for k, q in self.q.items()},
                "p": {k: p.detach().cpu().clone() for k, p in self.p.items()}, "calls": dict(self._calls),
                "residuals": {k: r.detach().cpu().clone() for k, r in self.residuals.items()},
                "exponents": {k: list(e) for k, e in self._exponents.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (an empty mapping restores nothing).

        Raises:
            ValueError: a ``q`` or ``p`` that is not a mapping of 2-D float32 tensors.
        """
        q, p = state.get("q", {}), state.get("p", {})
        for name, factors, dims in (("q", q, "cols x rank"), ("p", p, "rows x rank")):
            if not isinstance(factors, dict) or any(not isinstance(t, torch.Tensor) or t.dim() != 2
                                                    or t.dtype != torch.float32 for t in factors.values()):
                raise ValueError(f"state['{name}'] must map keys to 2-D float32 tensors ({dims})")
        self.q = {k: t.clone() for k, t in q.items()}
        self.p = {k: t.clone() for k, t in p.items()}
        self._calls = dict(state.get("calls", {}))
        self.residuals = {k: r.clone() for k, r in state.get("residuals", {}).items()}
        self._exponents = {k: list(e) for k, e in state.get("exponents", {}).items()}

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_checked"] = set()  # group ids mean nothing in another process
        d["_layouts"] = {}  # buffers: made again on first use
        del d["_busy"]
        return d

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._busy = threading.Lock()

    def __repr__(self) -> str:
        return (f"PowerSGD(rank={self.rank}, warm_start={self.warm_start}, "
                f"min_compression_rate={self.min_compression_rate:g}, start_iter={self.start_iter}, "
                f"compressor={self.compressor!r}, exchange={self.exchange!r}, alternating={self.alternating}, "
                f"alternate_after={self.alternate_after})")
