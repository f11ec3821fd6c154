"""FSDP2 HSDP: gradcomp's compressed all-reduce of each shard's gradient across the replicate dimension.

With a 2-D mesh ``(replicate, shard)`` FSDP2 reduce-scatters each module's
gradients inside the shard group, then all-reduces the shard across the
replicate group. :func:`gradcomp.fsdp.apply` gives every such parameter group
its 1-D shard view (:func:`shard_view`: FSDP then skips its own replicate
all-reduce) and a :class:`ReplicateAllReduce` hook (FSDP2's
``set_all_reduce_hook``, which runs right after the reduce-scatter): the
compressed allreduce (:func:`gradcomp.allreduce`) of the shard across the
replicate group, error feedback on this leg. With the shard groups inside
hosts and the replicate groups across them this is the hierarchical pattern
(exact inside a host, compressed between hosts; FSDP's parameter all-gather
of the next forward is its allgather). Every replica ends bit-identical.
Doc page: docs/fsdp2.md#hsdp.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

from gradcomp import _validate as v
from gradcomp import wire as W
from gradcomp.comm import DENSE_ALGORITHMS, Topology, allreduce
from gradcomp.comm import checked as _checked
from gradcomp.comm.agreement import signature
from gradcomp.comm.p2p import Comm
from gradcomp.comm.topology import layout
from gradcomp.residual_views import flat_residual

__all__ = ["ReplicateAllReduce", "MeshLegs", "REPLICATE_ALGORITHMS", "is_hsdp", "check_mesh", "shard_view",
           "EXACT_PHASE"]

#: algorithms of the replicate leg (gradcomp.allreduce's dense ones)
REPLICATE_ALGORITHMS = DENSE_ALGORITHMS
#: meter phase of FSDP's own exact reduce-scatter (nominal bytes of its ring)
EXACT_PHASE = "reduce_scatter_exact"
#: agreement ``algorithm`` code of the settings check at apply (apart from the collectives' codes)
SETTINGS_CODE = 102

logger = logging.getLogger(__name__)


def is_hsdp(mesh_info) -> bool:
    """FSDP2 made this parameter group's mesh info from a 2-D (HSDP) mesh."""
    return isinstance(mesh_info, HSDPMeshInfo)


def check_mesh(label: str, mesh_info) -> None:
    """Raise unless ``mesh_info`` is an HSDP mesh gradcomp can reduce over (local, the same on every rank).

    Raises:
        ValueError: not a 2-D ``(replicate, shard)`` mesh (the message names the module ``label``).
    """
    mesh = mesh_info.mesh
    if mesh.ndim != 2 or (mesh_info.replicate_mesh_dim, mesh_info.shard_mesh_dim) != (0, 1):
        raise ValueError(f"FSDP module {label!r}: HSDP needs a 2-D (replicate, shard) mesh, got "
                         f"{mesh.ndim} dims with replicate dim {mesh_info.replicate_mesh_dim} and shard dim "
                         f"{mesh_info.shard_mesh_dim}")


def shard_view(mesh_info) -> FSDPMeshInfo:
    """The 1-D FSDP view of an HSDP mesh info: same mesh, shard dim and groups, no replicate group
    (FSDP then reduce-scatters over the shard group and leaves the replicate leg to the hook)."""
    view = FSDPMeshInfo(mesh_info.mesh, shard_mesh_dim=mesh_info.shard_mesh_dim,
                        replicate_mesh_dim=mesh_info.replicate_mesh_dim, dp_mesh_dims=mesh_info.dp_mesh_dims,
                        spmd_mesh=mesh_info.spmd_mesh)
    view.reduce_scatter_process_group = mesh_info.reduce_scatter_process_group
    return view


class MeshLegs:
    """One HSDP mesh as the hook reduces over it (built by :meth:`ReplicateAllReduce.legs`).

    Attributes:
        grid: the mesh's global ranks, int64 ``[R, S]`` (row: a shard group).
        shard_size, shard_rank: the shard group's size and this rank's index in it.
        replicate_size, replicate_rank: the same for the replicate group.
        replicate: gradcomp's process group over the replicate group's ranks.
        mesh: gradcomp's process group over all the mesh's ranks.
        topology: the replicate leg's :class:`~gradcomp.Topology` (``"hierarchical"`` only, else None).
        tiered: the hosts are known: the shard leg counts in the meter's ``"intra_host"``
            tier, the replicate leg in ``"inter_host"``.
        resolved: :meth:`ReplicateAllReduce.resolve` ran (``topology`` and ``tiered`` are set).
    """

    def __init__(self, mesh_info, replicate, mesh):
        self.grid = mesh_info.mesh.mesh
        self.shard_size, self.shard_rank = mesh_info.shard_mesh_size, mesh_info.shard_mesh_rank
        self.replicate_size, self.replicate_rank = mesh_info.replicate_mesh_size, mesh_info.replicate_mesh_rank
        self.replicate, self.mesh = replicate, mesh
        self.topology, self.tiered, self.resolved = None, False, False


class ReplicateAllReduce:
    """The replicate leg of HSDP: gradcomp's compressed allreduce of each reduce-scattered shard.

    Made by :func:`gradcomp.fsdp.apply` for a model on a 2-D mesh. FSDP calls
    its hook with the module's reduce-scatter output (``S_m`` elements of the
    reduce dtype, every parameter's shard side by side); the hook all-reduces
    it in place across the replicate group with :func:`gradcomp.allreduce`
    (``algorithm``), op ``"avg"`` (``"sum"`` after
    ``set_gradient_divide_factor``, which then divides alone), so the result
    is FSDP2 HSDP's average with every replica bit-identical.

    Args:
        compressor: dense gradcomp compressor with a fixed wire size (checked by ``apply``).
        error_feedback: keep residuals on this leg (ignored for a lossless compressor).
        meter: optional TrafficMeter. timeout: seconds any exchange may take.
        algorithm: one of :data:`REPLICATE_ALGORITHMS`.
        topology: a :class:`~gradcomp.Topology` over the mesh's ranks, or None
            (``"hierarchical"``: from the environment; otherwise no tiers are counted).
        groups: gradcomp's process groups by ranks (shared with the other comms of ``apply``).

    Attributes:
        residuals: ``(name, shape, shard_dim, S, s, "replicate", R, r)`` -> float32
            ``[1, S_p]``: the error left on this rank's shard of the parameter.
        reduce_scatter: the compressed shard-leg comm, or None (FSDP's own exact one).
        allgather: the compressed parameter all-gather, or None.

    Raises:
        TypeError / ValueError: a bad ``algorithm`` or ``topology``.
    """

    def __init__(self, compressor, error_feedback: bool, meter, *, timeout: float, algorithm: str = "ring",
                 topology: Topology | None = None, groups=None):
        self.compressor = compressor
        self.error_feedback = v.flag("error_feedback", error_feedback)
        self.meter = meter
        self.timeout = timeout
        self.algorithm = v.choice("algorithm", algorithm, REPLICATE_ALGORITHMS)
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a gradcomp.Topology or None, got {type(topology).__name__}")
        self.topology = topology
        self.groups = groups
        self.reduce_scatter = None
        self.allgather = None
        self.residuals: dict[tuple, torch.Tensor] = {}
        self._flat: dict[object, tuple] = {}
        self._agreed: set[tuple] = set()
        self._warned: set[str] = set()
        self._legs: dict[tuple, MeshLegs] = {}
        self._partial: dict[int, torch.Tensor] = {}  # module -> shard sum kept by set_requires_all_reduce(False)

    @property
    def uses_residuals(self) -> bool:
        """Error feedback is on and the compressor is lossy."""
        return self.error_feedback and self.compressor.lossy

    def legs(self, mesh_info) -> MeshLegs:
        """The :class:`MeshLegs` of ``mesh_info``, its hosts not yet resolved (:meth:`resolve`);
        on a mesh's first call gradcomp's groups over its ranks are made (collective)."""
        grid = mesh_info.mesh.mesh
        key = (tuple(grid.shape), tuple(grid.flatten().tolist()))
        found = self._legs.get(key)
        if found is not None:
            return found
        replicate = self.groups.get(mesh_info.replicate_process_group)
        ranks = sorted(grid.flatten().tolist())
        mesh = dist.new_group(ranks, use_local_synchronization=True, timeout=datetime.timedelta(seconds=self.timeout))
        out = self._legs[key] = MeshLegs(mesh_info, replicate, mesh)
        return out

    def resolve(self, legs: MeshLegs, device) -> None:
        """Resolve the hosts of ``legs``'s mesh when there is a topology (or ``"hierarchical"``),
        once, collective over the mesh's ranks, and check the mesh against them.

        Raises:
            ValueError: a bad topology (see :func:`gradcomp.comm.topology.layout`), a shard
                group spanning hosts, or (flat algorithms) a replicate group with two ranks on
                one host: the same message on every rank of the mesh, before any payload moves.
        """
        if legs.resolved:
            return
        if self.topology is not None or self.algorithm == "hierarchical":
            host = self._hosts(legs.grid, sorted(legs.grid.flatten().tolist()), legs.mesh, device)
            legs.tiered = True
            if self.algorithm == "hierarchical":
                spec = self.topology or Topology()
                legs.topology = Topology(host=host, inter_algorithm=spec.inter_algorithm, segments=spec.segments)
        legs.resolved = True

    def agree_settings(self, module, legs: MeshLegs) -> None:
        """Check with every rank of the mesh at ``apply`` (one 56-byte signature to each) that they
        all-reduce the same layout (``module.details()``) with the same compressor, algorithm and
        kind of topology; before :meth:`resolve`, whose collective a rank without a topology skips.

        Raises:
            ValueError: they do not (the same message on every rank of the mesh).
        """
        comm = Comm(legs.mesh, self.timeout, self.meter)
        if comm.world_size == 1:
            return
        m = sum(p[3] for p in module.params(legs.shard_size))
        spec = self.topology
        # what every rank's spec shares (a host id given by host= differs between hosts)
        shared = None if spec is None else (spec.kind, spec.ranks_per_host, spec.inter_algorithm, spec.segments)
        details = {**module.details(), "replicate algorithm": self.algorithm, "topology": repr(shared)}
        sig = signature(numel=m, algorithm=SETTINGS_CODE, codec=W.codec(self.compressor.codec).id,
                        wire_nbytes=self.compressor.wire_nbytes((m,), torch.float32), details=details,
                        labels={"algorithm": {SETTINGS_CODE: "gradcomp HSDP settings"}})
        _checked.check_call(comm, sig, device=module.device)
        comm.release()

    def _hosts(self, grid: torch.Tensor, ranks: list[int], group, device) -> int:
        """This rank's host index under the topology, the mesh checked against the hosts."""
        lay = layout(group, self.topology, self.timeout, device)  # the same ValueError everywhere if bad
        host_of = {ranks[g]: h for h, members in enumerate(lay.hosts) for g in members}
        for row in grid.tolist():
            if len({host_of[r] for r in row}) > 1:
                raise ValueError(f"gradcomp HSDP: the shard group of ranks {row} spans hosts "
                                 f"{sorted({host_of[r] for r in row})}; its reduce-scatter must stay inside a "
                                 "host: lay the mesh out as (hosts, ranks per host), e.g. "
                                 "init_device_mesh(device, (hosts, ranks_per_host))")
        if self.algorithm != "hierarchical":
            for col in grid.t().tolist():
                if len({host_of[r] for r in col}) < len(col):
                    raise ValueError(f"gradcomp HSDP: the replicate group of ranks {col} has several ranks on "
                                     f"one host; algorithm={self.algorithm!r} would mix the tiers: use "
                                     "algorithm='hierarchical'")
        return lay.host

    # ---- the reduction -----------------------------------------------------------
    def hook(self, module, legs: MeshLegs):
        """The all-reduce hook of one FSDP module (``FSDPModule.set_all_reduce_hook``).

        The hook takes the module's reduce-scatter output (flat, ``S_m`` elements of
        float32 / bfloat16 / float16 on the parameters' device: CPU with gloo, CUDA with
        NCCL) and all-reduces it in place; :meth:`legs` gave ``legs``. It raises
        ValueError when the replicate group's ranks reduce different layouts or settings
        (checked on a module's first call, on every rank), TimeoutError / RuntimeError /
        gradcomp.PayloadError when the exchange fails (see :func:`gradcomp.allreduce`).
        """
        return lambda output: self._reduce(output, module, legs)

    def _reduce(self, output: torch.Tensor, module, legs: MeshLegs) -> None:
        """All-reduce ``output`` (one module's reduce-scatter output) in place across the replicate group."""
        group = module.param_group
        op = "avg" if group.gradient_divide_factor is None else "sum"
        x = output.view(-1)
        m, s_size, s_rank = x.numel(), legs.shard_size, legs.shard_rank
        if self.reduce_scatter is None and s_size > 1 and self.meter is not None:
            nbytes = (s_size - 1) * m * x.element_size()  # FSDP's own ring reduce-scatter
            tier = "intra_host" if legs.tiered else None
            self.meter.record_send(nbytes, nbytes, phase=EXACT_PHASE, tier=tier)
            self.meter.record_recv(nbytes, nbytes, phase=EXACT_PHASE, tier=tier)
        if self._accumulated(x, module, group.all_reduce_grads):
            return
        residual = None
        if self.uses_residuals and legs.replicate_size > 1:
            lay = module.layout(s_size * m, s_size, s_rank)
            if lay is None:
                if module.name not in self._warned:
                    self._warned.add(module.name)
                    logger.warning("gradcomp.hsdp: module %r: the parameters with gradients this step are "
                                   "ambiguous from the size %d; this all-reduce runs without error feedback",
                                   module.name, m)
            else:
                tail = ("replicate", legs.replicate_size, legs.replicate_rank)
                residual = flat_residual(self.residuals, self._flat, id(module),
                                         [(k + tail, lo, hi) for k, lo, hi in lay], m, 1, x.device)
        described = (id(module), m, op)
        kw = dict(op=op, algorithm=self.algorithm, group=legs.replicate, meter=self.meter, timeout=self.timeout,
                  residual=residual, out=x, check=described not in self._agreed, topology=legs.topology,
                  tag="gradcomp.hsdp")
        if legs.tiered and self.meter is not None:
            with self.meter.tier_scope("inter_host"):
                allreduce(x, self.compressor, **kw)
        else:
            allreduce(x, self.compressor, **kw)
        self._agreed.add(described)

    def _accumulated(self, x: torch.Tensor, module, all_reduce: bool) -> bool:
        """FSDP's ``set_requires_all_reduce(False)``, as native HSDP does it: keep the shard's
        sum here and hand FSDP zeros (True: nothing to all-reduce now); add what was kept
        to the next step that all-reduces (False)."""
        held = self._partial.pop(id(module), None)
        if not all_reduce:
            self._partial[id(module)] = x.clone() if held is None else held.add_(x)
            x.zero_()
            return True
        if held is not None:
            x.add_(held)
        return False

    # ---- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Residuals (CPU copies, by key), the compressor's state and the shard leg's state dict (if any)."""
        out = {"residuals": {k: r.detach().to("cpu", copy=True).contiguous() for k, r in self.residuals.items()},
               "compressor": self.compressor.state_dict()}
        if self.reduce_scatter is not None:
            out["reduce_scatter"] = self.reduce_scatter.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (keys that do not occur are kept, never used).

        Raises:
            ValueError: ``state`` is not a state dict of this class.
        """
        if not isinstance(state, dict) or not isinstance(state.get("residuals"), dict):
            raise ValueError("state must be a dict from ReplicateAllReduce.state_dict()")
        for k, r in state["residuals"].items():
            if not isinstance(k, tuple) or not isinstance(r, torch.Tensor) or r.dtype != torch.float32:
                raise ValueError(f"state['residuals'] must map key tuples to float32 tensors, got {k!r}")
        if ("reduce_scatter" in state) != (self.reduce_scatter is not None):
            raise ValueError("state and this comm disagree on a compressed shard leg (shard_compressor)")
        self.residuals = {k: r.clone() for k, r in state["residuals"].items()}
        self._flat.clear()
        if "compressor" in state:
            self.compressor.load_state_dict(state["compressor"])
        if self.reduce_scatter is not None:
            self.reduce_scatter.load_state_dict(state["reduce_scatter"])

    def __repr__(self) -> str:
        return (f"ReplicateAllReduce(compressor={self.compressor!r}, algorithm={self.algorithm!r}, "
                f"error_feedback={self.error_feedback}, {len(self.residuals)} residuals)")
