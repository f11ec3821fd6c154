"""FSDP2 (``fully_shard``): compressed reduce-scatter of gradients.

Usage::

    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    rs = gc.fsdp.apply(model, compressor=gc.Int8Quantizer(), error_feedback=True, meter=meter)
    # ... train as usual; torch.save(rs.state_dict(), ...) keeps the residuals

FSDP2 reduce-scatters each FSDP module's gradients once per backward: it
lays every parameter's gradient, padded on dim 0 to a multiple of the world
size ``N``, into one flat buffer of ``N`` equal chunks (chunk ``j`` holds every
parameter's shard ``j``) and calls its ``ReduceScatter`` comm
(``torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter``) with that
buffer, an output of one chunk, the group and the op (``AVG``; ``SUM`` when
FSDP divides itself, e.g. for float16 or ``set_force_sum_reduction_for_comms``;
``PREMUL_SUM(1/f)`` after ``set_gradient_divide_factor(f)``).
:class:`CompressedReduceScatter` is such a comm: the two-phase compressed
reduce-scatter (:func:`gradcomp.comm.reduce_scatter`): each rank quantizes
each other rank's chunk once and sends it to its owner, which sums in float32
(the qgZ part of ZeRO++, Wang et al. 2023, there with 4-bit codes; here any
gradcomp dense compressor). Set it on every FSDP module of a model with
:func:`apply` (or by hand: ``fsdp_module.set_custom_reduce_scatter(comm)``).

Error feedback (Seide et al. 2014; Karimireddy et al. 2019), per rank per
shard: rank ``r`` remembers, for every parameter, the error it made
compressing its gradient's chunks ``j != r`` (the chunk it owns is summed
exactly and keeps no residual). Through :func:`apply` residuals are keyed by
``(parameter name, shape, shard dim, world size, rank)`` and laid out per
parameter, so a parameter missing its gradient in one step, a new world size
(resharding) or a checkpoint loaded on another rank can never apply one
shard's residual to another (a residual whose key does not occur is never
used). Memory: one float32 per element of the *unsharded* model on every
rank (``(N - 1) / N`` of it non-zero), on the parameters' device; use
``error_feedback=False`` where that does not fit.

Traffic: gradcomp's point-to-point messages travel on a process group of its
own over the same ranks (made with ``dist.new_group``, so they never interleave with
FSDP's all-gathers); the meter gets the bytes each rank really sent and
received in phase ``"reduce_scatter"`` and, as raw bytes, what a float32
reduce-scatter would move: ``(N - 1) * 4 * S`` sent per rank for a chunk of
``S`` elements (FSDP's own, NCCL or gloo, with a float32 reduce dtype), plus
the ``"agreement"`` check :func:`apply` makes for each module.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import is_bw

from gradcomp import _validate as v
from gradcomp import timeline as _timeline
from gradcomp import wire as W
from gradcomp.comm import DEFAULT_TIMEOUT, INPUT_DTYPES, reduce_scatter
from gradcomp.comm import checked as _checked
from gradcomp.comm.agreement import signature
from gradcomp.comm.reduce_scatter import agree_reduce_scatter
from gradcomp.comm.p2p import Comm
from gradcomp.comm.topology import Topology
from gradcomp.compressors import Compressor, Int8Quantizer, unwrapped
from gradcomp.fsdp_layout import ModuleLayout
from gradcomp.hsdp import ReplicateAllReduce, check_mesh, is_hsdp, shard_view
from gradcomp.meter import TrafficMeter
from gradcomp.residual_views import flat_residual

__all__ = ["CompressedReduceScatter", "CompressedAllGather", "apply"]

logger = logging.getLogger(__name__)

_RedOpType = dist.ReduceOp.RedOpType
# FSDP's own exact all-gather (all_gather_into_tensor before torch 2.10)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CompressedReduceScatter(ReduceScatter):
    """FSDP2 ``ReduceScatter`` comm: gradcomp's compressed reduce-scatter with error feedback.

    Called by FSDP as ``comm(output_tensor, input_tensor, group, op)``:
    ``input_tensor`` is ``N * S`` elements of the reduce dtype (float32,
    bfloat16 or float16; chunk ``j`` = elements ``[j S, (j + 1) S)``),
    ``output_tensor`` ``S`` elements of the same dtype, on the group's device;
    ``op`` is ``ReduceOp.AVG``, ``SUM`` or ``PREMUL_SUM(f)``. It runs
    synchronously (on CUDA in FSDP's reduce-scatter stream) and returns None.
    With :class:`~gradcomp.Int8Quantizer` each element of the output is the
    float32 sum of every rank's value (the owner's exact, the others' quantized
    once with their error-feedback residual added), divided as ``op`` says.

    Use :func:`apply` to set it on every FSDP module of a model: residuals are
    then kept per parameter. Set by hand with ``set_custom_reduce_scatter``
    the comm cannot tell modules apart and keys residuals by the input's size,
    world size and rank only: give every module its own instance then.

    Args:
        compressor: a dense gradcomp compressor with a fixed wire size
            (default ``Int8Quantizer()``: block size 256, nearest rounding),
            not wrapped in ErrorFeedback.
        error_feedback: keep residuals (ignored for a lossless compressor).
        meter: optional :class:`~gradcomp.TrafficMeter`.
        timeout: seconds any exchange may take before the step fails.

    Attributes:
        residuals: key -> float32 residual: through :func:`apply`
            ``(name, shape, shard_dim, world_size, rank)`` -> ``[N, S_p]``
            (row ``j``: the error left on the parameter's chunk ``j``), else
            ``("", numel, world_size, rank)`` -> ``[numel]``.

    Raises:
        TypeError / ValueError: a bad setting (the message gives the reason).
    """

    def __init__(self, compressor: Compressor | None = None, error_feedback: bool = True,
                 meter: TrafficMeter | None = None, *, timeout: float = DEFAULT_TIMEOUT):
        self.compressor = _dense("compressor", Int8Quantizer() if compressor is None else compressor,
                                 "with error_feedback=True the comm keeps residuals per parameter shard")
        self.error_feedback = v.flag("error_feedback", error_feedback)
        self.meter = _meter(meter)
        self.timeout = v.timeout("timeout", timeout)
        #: gradcomp's process groups (shared with an all-gather comm by :func:`apply`)
        self.groups = _OwnGroups(self.timeout)
        #: the 8-bit parameter all-gather :func:`apply` set with it, if any
        self.allgather: CompressedAllGather | None = None
        self.residuals: dict[tuple, torch.Tensor] = {}
        self._flat: dict[object, tuple[tuple, torch.Tensor]] = {}  # module -> (keys, flat residual)
        self._agreed: set[tuple] = set()
        self._warned: set[str] = set()

    @property
    def uses_residuals(self) -> bool:
        """Error feedback is on and the compressor is lossy."""
        return self.error_feedback and self.compressor.lossy

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP's staging buffers: plain ``torch.empty`` (the caching allocator on CUDA)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` (see the class docstring).

        Raises:
            ValueError: ``async_op=True``, an op other than AVG / SUM /
                PREMUL_SUM, or ranks that disagree (see :func:`gradcomp.comm.reduce_scatter`).
            TimeoutError / RuntimeError / gradcomp.PayloadError: the exchange failed.
        """
        return self._reduce(output_tensor, input_tensor, group, op, async_op, None)

    # ---- the reduction -----------------------------------------------------------
    def _reduce(self, output, inp, group, op, async_op, module: "ModuleLayout | None") -> None:
        if async_op:
            raise ValueError("CompressedReduceScatter runs synchronously: call it with async_op=False")
        op_name, factor = _op(op)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        n = inp.numel()
        if n % world or output.numel() != n // world:
            raise ValueError(f"FSDP reduce-scatter: input of {n} elements and output of {output.numel()} "
                             f"do not make {world} equal chunks")
        residual = None
        if self.uses_residuals:
            layout = module.layout(n, world, rank) if module is not None else [(("", n, world, rank), 0, n)]
            if layout is None:
                if module.name not in self._warned:
                    self._warned.add(module.name)
                    logger.warning("gradcomp.fsdp: module %r: the parameters with gradients this step are "
                                   "ambiguous from the input size %d; this reduce-scatter runs without error "
                                   "feedback", module.name, n)
            else:
                slot = id(module) if module is not None else ("by size", n)  # by hand: one per input size
                residual = flat_residual(self.residuals, self._flat, slot, layout, n, world, inp.device,
                                         per_param=module is not None)
        own = self.groups.get(group)
        described = (id(module), n, op_name, world)
        reduce_scatter(inp, self.compressor, op=op_name, factor=factor, group=own, meter=self.meter,
                       timeout=self.timeout, residual=residual, out=output.view(-1),
                       check=described not in self._agreed, tag="gradcomp.fsdp")  # from any thread
        self._agreed.add(described)
        return None

    # ---- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Residuals (CPU copies, by key) and the compressor's state (its RNG counter)."""
        return {"residuals": {k: r.detach().to("cpu", copy=True).contiguous() for k, r in self.residuals.items()},
                "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (residuals move to the parameters'
        device at the next step; keys that do not occur there are kept, never used).

        Raises:
            ValueError: ``state`` is not a state dict of this class.
        """
        if not isinstance(state, dict) or not isinstance(state.get("residuals"), dict):
            raise ValueError("state must be a dict from CompressedReduceScatter.state_dict()")
        for k, r in state["residuals"].items():
            if not isinstance(k, tuple) or not isinstance(r, torch.Tensor) or r.dtype != torch.float32:
                raise ValueError(f"state['residuals'] must map key tuples to float32 tensors, got {k!r}")
        self.residuals = {k: r.clone() for k, r in state["residuals"].items()}
        self._flat.clear()
        if "compressor" in state:
            self.compressor.load_state_dict(state["compressor"])

    def _agree_settings(self, module: "ModuleLayout", own: dist.ProcessGroup, device) -> None:
        """Check with every rank at :func:`apply` that they reduce the same
        layout (each parameter's name, shape, dtypes and shard dim, in
        order) with the same compressor (so the first step need not)."""
        world = dist.get_world_size(own)
        if world == 1:
            return
        n = world * sum(p[3] for p in module.params(world))
        agree_reduce_scatter(Comm(own, self.timeout, self.meter), n, self.compressor, "avg", device,
                       details=module.details(), tag="gradcomp.fsdp")
        self._agreed.add((id(module), n, "avg", world))

    def _bind(self, name: str, param_group, names: dict[int, str]) -> "_BoundReduceScatter":
        return _BoundReduceScatter(self, ModuleLayout(name, param_group, names))

    def __repr__(self) -> str:
        return (f"CompressedReduceScatter(compressor={self.compressor!r}, "
                f"error_feedback={self.error_feedback}, {len(self.residuals)} residuals)")


class _OwnGroups:
    """gradcomp's process group over each FSDP group's ranks, made on first
    use (``dist.new_group(ranks, use_local_synchronization=True)``: only those
    ranks take part), so its point-to-point tags never meet FSDP's collectives."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def get(self, group) -> dist.ProcessGroup:
        ranks = tuple(dist.get_process_group_ranks(group))
        own = self._by_ranks.get(ranks)
        if own is None:
            own = self._by_ranks[ranks] = dist.new_group(
                list(ranks), use_local_synchronization=True, timeout=datetime.timedelta(seconds=self.timeout))
        return own


def _dense(name: str, compressor, hint: str) -> Compressor:
    compressor = unwrapped(compressor, name, hint)
    if compressor.sparse or compressor.wire_nbytes((1,), torch.float32) is None:
        raise ValueError(f"{name} must be dense with a fixed wire size (NoCompression, FP16, BF16, "
                         f"Int8Quantizer), got {compressor!r}")
    return compressor


def _meter(meter):
    if meter is not None and not isinstance(meter, TrafficMeter):
        raise TypeError(f"meter must be a gradcomp.TrafficMeter or None, got {type(meter).__name__}")
    return meter


#: agreement ``algorithm`` code of the parameter all-gather (apart from the
#: collectives' codes), so ranks that mix it up with another call fail cleanly
_ALLGATHER_CODE = 101


class CompressedAllGather(AllGather):
    """FSDP2 ``AllGather`` comm: parameters all-gathered in 8 bits in forward (qwZ).

    ZeRO++'s quantized weight communication (Wang et al. 2023): in forward
    each rank compresses its parameter shard once, the bytes travel the ring
    unchanged (:meth:`gradcomp.comm.p2p.Comm.ring_allgather`) and every rank,
    the owner included, decompresses every shard, so all ranks compute with
    the same (bit-identical) unsharded parameters. In backward
    (``reshard_after_forward=True`` gathers again) and for all-gather inputs
    that are not float32 / bfloat16 / float16 (FSDP packs mixed dtypes as
    uint8) it is FSDP's exact all-gather. With ``reshard_after_forward=False``
    backward reuses the forward's (quantized) parameters. Optimizer state and
    the sharded parameters stay exact; no error feedback (the error does not
    accumulate: every step quantizes the current exact shard afresh).

    Called by FSDP as ``comm(output_tensor, input_tensor, group, async_op)``
    with ``input_tensor`` this rank's ``M`` elements (a view of
    ``output_tensor[rank M:(rank + 1) M]``) and ``output_tensor`` ``N M``
    elements; it runs synchronously and returns None (FSDP then treats the
    gather as done).

    Error: with :class:`~gradcomp.Int8Quantizer` (nearest rounding) each
    gathered element is off by at most ``0.5 * A / 127`` (``A``: absmax of its
    block of this shard). :attr:`max_relative_error` records the largest
    ``||D(C(x)) - x|| / ||x||`` over this rank's shards so far.

    Traffic: meter phase ``"allgather"``: ``N - 1`` payloads sent and received
    per call, raw bytes ``(N - 1) * M * itemsize`` (what FSDP's all-gather of
    the same input moves); exact gathers in phase ``"allgather_exact"`` at that
    nominal volume.

    Args:
        compressor: dense gradcomp compressor (default ``Int8Quantizer()``).
        meter: optional :class:`~gradcomp.TrafficMeter`.
        timeout: seconds any exchange may take.
    """

    def __init__(self, compressor: Compressor | None = None, meter: TrafficMeter | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT, groups: "_OwnGroups | None" = None):
        self.compressor = _dense("allgather", Int8Quantizer() if compressor is None else compressor,
                                 "parameters are gathered without error feedback")
        self.meter = _meter(meter)
        self.timeout = v.timeout("timeout", timeout)
        self.groups = _OwnGroups(self.timeout) if groups is None else groups
        self.max_relative_error = 0.0
        self._agreed: set[tuple] = set()

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP's all-gather output buffer: plain ``torch.empty``."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        """All-gather ``input_tensor`` into ``output_tensor`` (see the class docstring).

        Raises:
            ValueError: the ranks disagree on sizes or compressor settings.
            TimeoutError / RuntimeError / gradcomp.PayloadError: the exchange failed.
        """
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        m = input_tensor.numel()
        if output_tensor.numel() != world * m:
            raise ValueError(f"FSDP all-gather: output of {output_tensor.numel()} elements for {world} "
                             f"inputs of {m}")
        if is_bw() or input_tensor.dtype not in INPUT_DTYPES:
            _all_gather_single(output_tensor, input_tensor, group=group)
            if self.meter is not None:
                nbytes = (world - 1) * m * input_tensor.element_size()
                self.meter.record_send(nbytes, nbytes, phase="allgather_exact")
                self.meter.record_recv(nbytes, nbytes, phase="allgather_exact")
            return None
        comm = Comm(self.groups.get(group), self.timeout, self.meter)
        x = input_tensor.detach().reshape(-1)
        wire_nbytes = self.compressor.wire_nbytes((m,), x.dtype)
        self._agree(comm, m, x.dtype, x.device)
        with _timeline.span("compress"):
            mine = self.compressor.compress(x).wire
        if mine.numel() != wire_nbytes:
            raise RuntimeError(f"{self.compressor!r} wrote {mine.numel()} bytes for {m} elements, "
                               f"its wire_nbytes() says {wire_nbytes}")
        exact = x.clone() if m else x
        out = output_tensor.view(world, m)

        def decompress(j: int, blob: torch.Tensor) -> None:
            with _timeline.span("decompress"):
                self.compressor.decompress(W.decode(blob), out=out[j])

        comm.ring_allgather(mine, [wire_nbytes] * world, [m * x.element_size()] * world,
                            phase="allgather", consume=decompress)
        comm.release()
        if m:
            norm = exact.float().norm()
            if norm > 0:
                err = (out[rank].float() - exact.float()).norm() / norm
                self.max_relative_error = max(self.max_relative_error, float(err))
        return None


    def _agree(self, comm: Comm, m: int, dtype: torch.dtype, device) -> None:
        """Every rank gathers ``m`` elements of ``dtype`` with the same
        compressor: checked once per size (at :func:`apply`, or the first gather)."""
        described = (m, comm.world_size, dtype)
        if described in self._agreed or comm.world_size == 1:
            return
        sig = signature(numel=comm.world_size * m, algorithm=_ALLGATHER_CODE,
                        codec=W.codec(self.compressor.codec).id, wire_nbytes=self.compressor.wire_nbytes((m,), dtype),
                        details={"call": "gradcomp.fsdp parameter all-gather", "dtype": str(dtype)},
                        labels={"algorithm": {_ALLGATHER_CODE: "fsdp parameter all-gather"}})
        _checked.check_call(comm, sig, device=device)
        self._agreed.add(described)

    def _agree_settings(self, param_group, own: dist.ProcessGroup) -> None:
        """:meth:`_agree` at :func:`apply` for a module whose parameters gather in one float dtype."""
        policy = param_group.mp_policy
        dtypes = {policy.param_dtype or fp.sharded_param.dtype for fp in param_group.fsdp_params}
        if len(dtypes) == 1 and next(iter(dtypes)) in INPUT_DTYPES:
            m = sum(fp.padded_sharded_param_size.numel() for fp in param_group.fsdp_params)
            self._agree(Comm(own, self.timeout, self.meter), m, dtypes.pop(), param_group.device)


class _BoundReduceScatter(ReduceScatter):
    """The comm one FSDP module calls: the shared :class:`CompressedReduceScatter`
    with that module's parameter layout."""

    def __init__(self, parent: CompressedReduceScatter, module: ModuleLayout, tier: str | None = None):
        self.parent, self.module, self.tier = parent, module, tier  # tier: the meter's, for HSDP's shard group

    def allocate(self, size, *, dtype, device):
        return self.parent.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if self.tier is None:
            return self.parent._reduce(output_tensor, input_tensor, group, op, async_op, self.module)
        with self.parent.meter.tier_scope(self.tier):
            return self.parent._reduce(output_tensor, input_tensor, group, op, async_op, self.module)


def _op(op) -> tuple[str, float]:
    """``(op, factor)`` for :func:`gradcomp.comm.reduce_scatter` from FSDP's ReduceOp."""
    kind = getattr(op, "op", op)  # a ReduceOp object, or a RedOpType such as ReduceOp.AVG
    if kind == _RedOpType.AVG:
        return "avg", 1.0
    if kind == _RedOpType.SUM:
        return "sum", 1.0
    if kind == _RedOpType.PREMUL_SUM:
        f = op.factor
        return "sum", float(f.item() if isinstance(f, torch.Tensor) else f)
    raise ValueError(f"op must be ReduceOp.AVG, SUM or PREMUL_SUM (what FSDP2 uses for gradients), got {kind}")


def apply(module: nn.Module, compressor: Compressor | None = None, error_feedback: bool = True,
          meter: TrafficMeter | None = None, *, allgather: Compressor | None = None,
          timeout: float = DEFAULT_TIMEOUT, algorithm: str | None = None, topology: Topology | None = None,
          shard_compressor: Compressor | None = None) -> CompressedReduceScatter | ReplicateAllReduce:
    """Set gradcomp's gradient reduction on every FSDP2 module of ``module``.

    1-D meshes: one :class:`CompressedReduceScatter` (``compressor``) on every
    FSDP module. 2-D (HSDP) meshes: a :class:`~gradcomp.hsdp.ReplicateAllReduce`
    all-reduce hook compresses each shard's gradient across the replicate
    dimension (``compressor``, ``algorithm``, ``topology``, error feedback on
    this leg) after the shard group's reduce-scatter, FSDP's own exact one or
    (``shard_compressor``) a :class:`CompressedReduceScatter` (docs/fsdp2.md#hsdp).

    Call it on every rank, after ``fully_shard`` and before the first
    backward. It checks everything a step would otherwise trip on and raises
    here: no FSDP module, a module with several parameter groups, a
    replicate-only mesh or 1-D and 2-D meshes mixed, a device other than CPU or CUDA, a reduce dtype other
    than float32 / bfloat16 / float16, a custom reduce-scatter (or, with
    ``allgather``, all-gather, or with HSDP an all-reduce hook) already set, a bad compressor, a bad
    topology or a mesh the hosts do not fit (HSDP; collective over the mesh's ranks), and (one
    40-byte message to each peer per FSDP module) ranks whose compressors or
    parameter layouts differ: every rank raises the same ValueError. Parameters
    outside FSDP modules are left alone (their gradients are the caller's to
    reduce, as with plain FSDP2).

    Args:
        module: a model with ``fully_shard`` applied to it or to submodules.
        compressor, error_feedback, meter, timeout: see :class:`CompressedReduceScatter`
            (HSDP: of the replicate leg).
        allgather: optional dense compressor (e.g. ``gc.Int8Quantizer()``)
            for the forward all-gather of parameters (:class:`CompressedAllGather`,
            same meter); None keeps FSDP's exact all-gather.
        algorithm: HSDP only: the replicate leg's :func:`gradcomp.allreduce`
            algorithm, one of :data:`gradcomp.hsdp.REPLICATE_ALGORITHMS` (None: ``"ring"``).
        topology: HSDP only: a :class:`gradcomp.Topology` over the mesh's ranks;
            then every shard group must lie in one host and the meter counts
            tiers. None: from the environment for ``"hierarchical"``, else no tiers.
        shard_compressor: HSDP only: dense compressor of the shard group's
            reduce-scatter; None keeps FSDP's exact one.

    Returns:
        1-D: the comm (its :meth:`~CompressedReduceScatter.state_dict` holds the
        residuals; its ``allgather`` attribute the all-gather comm, or None).
        HSDP: the :class:`~gradcomp.hsdp.ReplicateAllReduce` (its ``reduce_scatter``
        and ``allgather`` attributes the shard-group comms, or None).

    Raises:
        TypeError / ValueError: see above (the message names the module).
        RuntimeError: torch.distributed is not initialised.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("gradcomp.fsdp.apply needs torch.distributed initialised first")
    found = _param_groups(module)
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    kinds = {is_hsdp(g.mesh_info) for _, _, g in found}
    if len(kinds) > 1:
        raise ValueError("module mixes FSDP modules on 1-D meshes with HSDP (2-D) ones; give them one kind")
    if kinds == {True}:
        rep = _hsdp_comm(compressor, error_feedback, meter, timeout, "ring" if algorithm is None else algorithm,
                         topology, shard_compressor, allgather)
        return _apply_hsdp(found, names, rep)
    given = [k for k, x in (("algorithm", algorithm), ("topology", topology), ("shard_compressor", shard_compressor))
             if x is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: for the replicate dimension of a 2-D (HSDP) mesh only; "
                         "this model's FSDP meshes are 1-D")
    comm = CompressedReduceScatter(compressor, error_feedback, meter, timeout=timeout)
    if allgather is not None:
        comm.allgather = CompressedAllGather(allgather, meter, timeout=timeout, groups=comm.groups)
    bound = []
    for name, m, g in found:
        _check_group(name or "<root>", g, comm.allgather is not None)
        bound.append((m, comm._bind(name, g, names), g.mesh_info.shard_process_group))
    for m, b, group in bound:  # every rank makes gradcomp's group and checks the settings now
        own = comm.groups.get(group)
        comm._agree_settings(b.module, own, b.module.device)
        if comm.allgather is not None:
            comm.allgather._agree_settings(b.module.param_group, own)
    for m, b, group in bound:
        m.set_custom_reduce_scatter(b)
        if comm.allgather is not None:
            m.set_custom_all_gather(comm.allgather)
    return comm


def _param_groups(module: nn.Module) -> list:
    """``(name, FSDP module, its parameter group)`` of every FSDP module with parameters of its own."""
    found = [(name, m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError("module has no FSDP2 module: call torch.distributed.fsdp.fully_shard on it "
                         "(or on its submodules) first")
    out = []
    for name, m in found:
        groups = m._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(f"FSDP module {name or '<root>'!r} has {len(groups)} parameter groups (per-parameter "
                             "meshes); a custom reduce-scatter needs one")
        if groups:  # none: no parameters of its own, FSDP never reduce-scatters for it
            out.append((name, m, groups[0]))
    return out


def _hsdp_comm(compressor, error_feedback, meter, timeout, algorithm, topology, shard_compressor,
               allgather) -> ReplicateAllReduce:
    """The HSDP comms of :func:`apply` (arguments checked), sharing gradcomp's groups."""
    groups = _OwnGroups(v.timeout("timeout", timeout))
    rep = ReplicateAllReduce(_dense("compressor", Int8Quantizer() if compressor is None else compressor,
                                    "with error_feedback=True the replicate all-reduce keeps residuals per shard"),
                             error_feedback, _meter(meter), timeout=groups.timeout, algorithm=algorithm,
                             topology=topology, groups=groups)
    if shard_compressor is not None:
        rep.reduce_scatter = CompressedReduceScatter(shard_compressor, error_feedback, meter, timeout=timeout)
        rep.reduce_scatter.groups = groups
    if allgather is not None:
        rep.allgather = CompressedAllGather(allgather, meter, timeout=timeout, groups=groups)
    return rep


def _apply_hsdp(found, names, rep: ReplicateAllReduce) -> ReplicateAllReduce:
    """:func:`apply` on HSDP meshes (see there): checks, then the collectives, then the hooks."""
    groups = rep.groups
    for name, m, g in found:
        _check_group(name or "<root>", g, rep.allgather is not None, hsdp=True)
    bound = []
    for name, m, g in found:  # collective: the hosts (once per mesh), gradcomp's groups, the settings
        mod = ModuleLayout(name, g, names)
        legs = rep.legs(g.mesh_info)
        rep.agree_settings(mod, legs)
        rep.resolve(legs, mod.device)
        tier = "intra_host" if legs.tiered and rep.meter is not None else None
        with rep.meter.tier_scope(tier) if tier else contextlib.nullcontext():
            own = groups.get(g.mesh_info.shard_process_group)
            if rep.reduce_scatter is not None:
                rep.reduce_scatter._agree_settings(mod, own, mod.device)
            if rep.allgather is not None:
                rep.allgather._agree_settings(g, own)
        bound.append((m, mod, legs, tier))
    for m, mod, legs, tier in bound:
        m.set_all_reduce_hook(rep.hook(mod, legs))
        if rep.reduce_scatter is not None:
            m.set_custom_reduce_scatter(_BoundReduceScatter(rep.reduce_scatter, mod, tier))
        if rep.allgather is not None:
            m.set_custom_all_gather(rep.allgather)
        mod.param_group.mesh_info = shard_view(mod.param_group.mesh_info)  # FSDP skips its replicate all-reduce
    return rep


def _check_group(label: str, group, allgather: bool, hsdp: bool = False) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    mesh_info = group.mesh_info
    if group._all_reduce_hook is not None:
        raise ValueError(f"FSDP module {label!r} already has an all-reduce hook; apply gradcomp to a model once")
    if hsdp:
        check_mesh(label, mesh_info)
    elif not hasattr(mesh_info, "shard_process_group") or mesh_info.mesh.ndim != 1:
        raise ValueError(f"FSDP module {label!r}: only 1-D FSDP meshes and 2-D HSDP meshes are supported "
                         f"(replicate-only meshes are not), got a {mesh_info.mesh.ndim}-D mesh")
    if group.device.type not in ("cpu", "cuda"):
        raise ValueError(f"FSDP module {label!r}: device must be cpu (gloo) or cuda (NCCL), got {group.device}")
    current = [group._reduce_scatter_comm] + ([group._all_gather_comm] if allgather else [])
    for c, default, what in zip(current, (DefaultReduceScatter, DefaultAllGather), ("reduce-scatter", "all-gather")):
        if not isinstance(c, default):
            raise ValueError(f"FSDP module {label!r} already has a custom {what} comm "
                             f"({type(c).__name__}); apply gradcomp to a model once")
    policy = group.mp_policy
    for fp in group.fsdp_params:
        p = fp.sharded_param
        if not p.requires_grad:
            continue
        dtype = policy.reduce_dtype or policy.param_dtype or p.dtype
        if dtype not in INPUT_DTYPES:
            raise TypeError(f"FSDP module {label!r}: parameter gradients would be reduced in {dtype}; "
                            "gradcomp reduces float32, bfloat16 or float16 (set MixedPrecisionPolicy(reduce_dtype=...))")
