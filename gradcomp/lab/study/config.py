"""Settings of a training study and the compressors it can compare.

Importing this module imports no torch (``gradcomp train --help`` builds its
parser from it): the codecs load in :meth:`CompressorChoice.build`, the local
mode's schedule check when a :class:`TrainConfig` is made.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from gradcomp import catalog
from gradcomp.lab.study.menu import DEFAULT_HIDDEN, DEFAULT_WORKLOAD, WORKLOADS

if TYPE_CHECKING:
    from gradcomp.adaptive import Adaptive
    from gradcomp.compressors import Compressor
    from gradcomp.lab.study.torch_powersgd import TorchPowerSGD

__all__ = ["TrainConfig", "CompressorChoice", "COMPRESSORS", "DEFAULT_COMPRESSORS", "MODES",
           "ALGORITHMS", "SPARSE_ALGORITHMS", "parse_compressors", "ALL_MODES"]

MODES = ("sync", "async")
#: Every mode ``--mode`` accepts: MODES (``both``) plus local SGD / DiLoCo
#: (:mod:`gradcomp.lab.study.local`), auto: local SGD whose period and codec are chosen
#: online (one row, ``auto``, whatever ``--compressors`` lists), and sync on torchft's
#: quorum (:mod:`gradcomp.lab.study.ft`).
ALL_MODES = (*MODES, "local", "auto", "ft")
#: Dense algorithms of the sync and local modes (``--algorithm``).
ALGORITHMS = ("ring", "two_phase", "hierarchical", "halving_doubling")
#: Algorithms of the exact top-k rows (``--sparse-algorithm``); threshold and
#: DGC rows always use ``allgather`` (data-dependent sizes; DGC selects per parameter).
SPARSE_ALGORITHMS = ("allgather", "sparse_reduce_scatter")
#: the menu entries ``--sparse-algorithm`` applies to
_TOPK_ROWS = ("topk-ef", "topk-int8-ef")
#: the dense algorithms ``auto``'s policy runs (gradcomp.comm.FLAT_DENSE_ALGORITHMS; plain data
#: here: ``gradcomp train --help`` imports no torch)
_POLICY_ALGORITHMS = ("ring", "two_phase")
#: compressed steps of the full power iteration before the ``powersgd4-alt`` row alternates: the
#: first steps' leading subspace moves too fast for a basis one step old (docs/powersgd.md)
ALTERNATE_AFTER = 50
#: Largest ``timeout`` of a run, in seconds.
MAX_TIMEOUT = 1e7
#: Largest ``dgc_warmup_epochs`` (a warm-up in steps then stays an exact int64
#: for any data set: a larger one overflows the step count)
MAX_WARMUP_EPOCHS = 1e6


@dataclass(frozen=True)
class CompressorChoice:
    """One entry of the study's compressor menu: a name of :mod:`gradcomp.catalog` (whose
    entry says what it builds) or one of the study's own rows, ``auto`` and ``native``.

    Attributes:
        name: command-line name (``--compressors``).
        label: name shown in reports.
        error_feedback: wrap the codec in error feedback (residual memory per tensor).
        dgc: Deep Gradient Compression around the top-k (:mod:`gradcomp.lab.study.dgc`).
        modes: the modes it can run in (``auto``, adaptive compression, needs
            the DDP hook: sync only).
        native: uncompressed, on the backend's own ``dist.all_reduce`` (what
            DDP does without a hook) instead of gradcomp's ring: the
            baseline a user would call (``none`` runs gradcomp's transport,
            so that its bytes are those of the compressed rows' transport).
        low_rank: the rank of a :class:`gradcomp.PowerSGD` row (0: not one): low-rank
            factors per parameter, not a per-tensor codec, so the DDP hook and local
            SGD run it and the parameter server does not.
        torch_hook: with ``low_rank``: PyTorch's own ``powerSGD_hook`` at that rank
            (:class:`gradcomp.lab.study.torch_powersgd.TorchPowerSGD`, sync mode) instead of
            gradcomp's.
        alternating: with ``low_rank`` (gradcomp's): half a power iteration per step, one
            collective, after :data:`ALTERNATE_AFTER` steps of the full iteration
            (``gc.PowerSGD(alternating=True, alternate_after=ALTERNATE_AFTER)``).
        entry: the catalog name it builds, where it differs from ``name``.
        momentum_free: the optimizer runs without momentum at the learning rate
            ``lr / (1 - momentum)`` (the momentum run's long-run step): EF-SignSGD's own
            algorithm (Karimireddy et al. 2019), since momentum on top of the sign code's
            error feedback loses accuracy (docs/results/codecs.md#why-sign-ef-loses-on-text-gpt).
        server_ef: the row runs ``two_phase`` whatever ``--algorithm`` says, its owners
            compressing the average with a residual of their own (server error feedback,
            DoubleSqueeze, Tang et al. 2019): every compression of the exchange has error feedback.
    """

    name: str
    label: str
    error_feedback: bool
    dgc: bool = False
    modes: tuple[str, ...] = ALL_MODES
    native: bool = False
    low_rank: int = 0
    torch_hook: bool = False
    alternating: bool = False
    entry: str | None = None
    momentum_free: bool = False
    server_ef: bool = False

    def build(self, threshold: float | None = None, link: tuple[float, float] | None = None,
              start_iter: int = 0) -> "Compressor | Adaptive | TorchPowerSGD":
        """A fresh codec (without error feedback: the transport's state adds it);
        for ``auto`` a fresh :class:`gradcomp.Adaptive` policy; for a ``torch_hook`` row
        PyTorch's hook (uncounted: the sync mode gives it the run's meter).

        Args:
            threshold: magnitude threshold for ``threshold-ef`` (required there,
                ignored by the other rows).
            link: ``auto``'s link prior (``gc.Adaptive(link=)``), or None.
            start_iter: a low-rank row's first compressed call (the calls before it are
                exact; PyTorch's row at least 2, its hook's minimum); ignored by the other rows.

        Raises:
            ValueError: ``threshold-ef`` without a threshold.
        """
        if self.name == "auto":
            from gradcomp.adaptive import Adaptive

            return Adaptive(link=link)
        if self.low_rank and self.torch_hook:
            from gradcomp.lab.study.torch_powersgd import TorchPowerSGD  # imports torch: loaded on use

            return TorchPowerSGD(rank=self.low_rank, start_iter=max(start_iter, 2))
        if self.low_rank:
            from gradcomp.powersgd import PowerSGD  # imports torch: loaded on use (see the module docstring)

            return PowerSGD(rank=self.low_rank, start_iter=start_iter, alternating=self.alternating,
                            alternate_after=ALTERNATE_AFTER if self.alternating else 0)
        entry = catalog.entry("none" if self.native else self.entry or self.name)
        if entry.kind == "threshold" and threshold is None:
            raise ValueError(f"{self.name} needs a threshold")
        return entry.build(threshold=threshold if entry.kind == "threshold" else None)

    @property
    def sparse(self) -> bool:
        name = self.entry or self.name
        return name in catalog.ENTRIES and catalog.ENTRIES[name].sparse

    def optimizer(self, lr: float, momentum: float) -> tuple[float, float]:
        """The SGD ``(lr, momentum)`` of this row's runs given the study's: unchanged, or for a
        ``momentum_free`` row ``(lr / (1 - momentum), 0)``."""
        return (lr / (1.0 - momentum), 0.0) if self.momentum_free else (lr, momentum)


def _catalog_row(name: str) -> CompressorChoice:
    e = catalog.entry(name)
    # DGC's momentum correction lives in the DDP hook and the server, not in the ft mode's allreduce
    modes = tuple(m for m in ALL_MODES if m != "ft") if e.dgc else ALL_MODES
    return CompressorChoice(name, e.label, e.error_feedback, dgc=e.dgc, modes=modes)


COMPRESSORS: dict[str, CompressorChoice] = {c.name: c for c in (
    *(_catalog_row(n) for n in ("none", "fp16", "bf16", "int8", "int8-ef", "fp8", "fp8-ef", "fp8-e5m2",
                                "int4", "int4-ef", "int2-ef", "sign-ef", "topk-ef", "topk-int8-ef",
                                "threshold-ef", "dgc", "dgc-int8")),
    # (no "int2" / "sign" rows: biased without error feedback, they are the catalog's for policies
    # that keep residuals themselves; a training row runs them with it)
    # the study's own rows: a policy over catalog codecs, and the backend's uncompressed collective
    CompressorChoice("auto", "auto", True, modes=("sync", "auto")),
    CompressorChoice("native", "all_reduce f32", False, modes=("sync",), native=True),
    # sign + EF under plain SGD at the momentum run's long-run step (EF-SignSGD's algorithm), with
    # error feedback on both sides of two-phase (the ring re-compresses partial sums without one)
    CompressorChoice("sign-ef-sgd", "sign+ef2 sgd", True, modes=("sync",), entry="sign-ef", momentum_free=True,
                     server_ef=True),
    # PowerSGD rank 4 (FP16 factors, error feedback per parameter): the DDP hook and local SGD
    CompressorChoice("powersgd4", "powersgd r4", True, modes=("sync", "local"), low_rank=4),
    # the same with one collective per step (P's and Q's on alternate steps) after ALTERNATE_AFTER
    CompressorChoice("powersgd4-alt", "powersgd r4 alt", True, modes=("sync", "local"), low_rank=4,
                     alternating=True),
    # PyTorch's own powerSGD_hook at rank 4 with its defaults, beside it (the DDP hook only)
    CompressorChoice("torch-powersgd4", "torch powerSGD r4", True, modes=("sync",), low_rank=4, torch_hook=True),
    # both at rank 32, where the wide MLP's exchange is hundreds of KB a step (communication-bound
    # at 100 Mbit; at rank 4 the DDP step's compute dominates)
    CompressorChoice("powersgd32", "powersgd r32", True, modes=("sync", "local"), low_rank=32),
    CompressorChoice("torch-powersgd32", "torch powerSGD r32", True, modes=("sync",), low_rank=32, torch_hook=True),
)}

#: The default study's menu, baseline first.
DEFAULT_COMPRESSORS = ("none", "fp16", "int8", "int8-ef", "topk-ef", "topk-int8-ef", "threshold-ef",
                       "dgc", "dgc-int8")


def parse_compressors(text: str) -> tuple[str, ...]:
    """Parse a comma-separated list of compressor names (duplicates dropped, order kept).

    Raises:
        ValueError: an empty list or an unknown name (the message lists the allowed ones).
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no compressor given; allowed: {','.join(COMPRESSORS)}")
    unknown = [n for n in names if n not in COMPRESSORS]
    if unknown:
        raise ValueError(f"unknown compressor name(s): {', '.join(unknown)}; "
                         f"allowed: {','.join(COMPRESSORS)}")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; every run of a study shares it, so results
    differ by compressor (and mode) alone.

    Attributes:
        workers: data-parallel workers (in async mode a parameter server comes on top).
        steps: optimizer steps per run; every worker computes one batch per step.
        batch_size: samples per worker per step (global batch = workers x batch_size).
        lr: SGD learning rate of a sync step (async: each push is applied with
            ``lr / workers``, see :mod:`gradcomp.lab.study.async_`); momentum: SGD momentum.
        dgc_warmup_epochs: the DGC rows' warm-up, in epochs of the training data
            (0: none, at most :data:`MAX_WARMUP_EPOCHS`; see :mod:`gradcomp.lab.study.dgc`).
        async_momentum: the server's SGD momentum in async mode (None: ``momentum``).
            Asynchrony itself acts like momentum (Mitliagkas et al. 2016,
            "Asynchrony begets momentum": about ``1 - 1/workers`` with stale
            gradients), so a stable async run often needs less explicit momentum.
        auto_link: the ``auto`` rows' link prior ``(latency_s, bytes_per_s)``
            (:class:`gradcomp.Adaptive`'s ``link``), or None.
        seed: model initialisation, data split and data order.
        hidden: hidden-layer widths of the MLP.
        test_fraction: share of the digits held out for testing.
        algorithm: allreduce of the dense codecs (:data:`ALGORITHMS`;
            ``hierarchical``: exact inside a host, compressed across hosts);
            ``auto`` rows use ``ring`` when it is not among the adaptive
            policy's algorithms.
        sparse_algorithm: allreduce of the exact top-k rows
            (:data:`SPARSE_ALGORITHMS`); the other sparse rows use ``allgather``.
        ranks_per_host: workers sharing a host (``--topology HxR``: ``workers
            = H x R``); 1: one per host.
        eval_every: steps between test-set evaluations (and the last step).
        threshold: threshold of ``threshold-ef`` (None: calibrated, see :mod:`gradcomp.lab.study.study`).
        timeout: seconds allowed for one run before its processes are stopped.
        straggler: ``(worker, factor)``: that worker's compute takes ``factor``
            times as long (see :mod:`gradcomp.lab.study.timing`); None: no straggler.
        straggler_from_s: seconds into each run's training clock from which the
            straggler is slow (0: from the start).
        backup_workers: None: sync mode runs gradcomp's allreduce; an int
            ``b``: sync mode runs through the parameter server, a step applied
            with the first ``workers - b`` pushes (0: every push; Chen et al.
            2016, "Revisiting Distributed Synchronous SGD"), in ``[0, workers)``.
        ft_timeout: the ft mode's quorum join timeout in seconds (torchft's
            lighthouse ``join_timeout_ms``): a worker that asks to join a step's
            quorum later than this after the first is left out of it, in (0, 60].
        label_skew: None (i.i.d. batches) or the Dirichlet concentration of the workers'
            class proportions (:func:`gradcomp.lab.study.data.skewed_shard`; > 0).
        compute_jitter: coefficient of variation of every worker's per-step
            compute stretch (lognormal, seeded; 0: none).
        sync_every, outer, fragments, overlap: the local mode's schedule
            (:class:`gradcomp.LocalSGD`: ``H``, ``"avg"`` or ``"nesterov"``,
            ``F``, ``tau``).
        min_sync_every, max_sync_every, period_cost, comm_share: the auto mode's bounds of
            the period and its rule (``LocalSGD(sync_every="auto")``, None: its default;
            its outer step is ``outer``).
        partial_work: whether a slow worker runs fewer inner steps of a round instead of holding
            it up (``LocalSGD(partial_work=True)``) in the local and auto modes; None: the auto
            mode only.
        workload: a name of :data:`gradcomp.lab.study.workloads.WORKLOADS`
            (``hidden`` applies to ``digits-mlp`` only).
        data_dir: CIFAR-10's folder (``cifar10-resnet18``); data_file: the
            text file (``text-gpt``).
    """

    workers: int = 4
    steps: int = 350
    batch_size: int = 64
    lr: float = 0.1
    momentum: float = 0.9
    async_momentum: float | None = None
    dgc_warmup_epochs: float = 0.0
    auto_link: tuple[float, float] | None = None
    seed: int = 0
    hidden: tuple[int, ...] = field(default=DEFAULT_HIDDEN)
    test_fraction: float = 0.25
    algorithm: str = "ring"
    sparse_algorithm: str = "allgather"
    ranks_per_host: int = 1
    eval_every: int = 10
    threshold: float | None = None
    timeout: float = 600.0
    straggler: tuple[int, float] | None = None
    straggler_from_s: float = 0.0
    compute_jitter: float = 0.0
    label_skew: float | None = None
    backup_workers: int | None = None
    ft_timeout: float = 0.05
    sync_every: int = 32
    outer: str = "avg"
    fragments: int = 1
    overlap: int = 0
    min_sync_every: int = 1
    max_sync_every: int = 64
    comm_share: float | None = None
    period_cost: float | None = None
    partial_work: bool | None = None
    workload: str = DEFAULT_WORKLOAD
    data_dir: str | None = None
    data_file: str | None = None

    def algorithm_for(self, choice: CompressorChoice) -> str:
        """The allreduce algorithm of ``choice``'s sync and local runs (see the attributes)."""
        if choice.server_ef:
            return "two_phase"  # the one algorithm whose owners keep a residual
        if choice.sparse:
            return self.sparse_algorithm if choice.name in _TOPK_ROWS else "allgather"
        if choice.name == "auto" and self.algorithm not in _POLICY_ALGORITHMS:
            return "ring"
        return self.algorithm

    def momentum_for(self, mode: str) -> float:
        """The SGD momentum of ``mode``'s runs: ``async_momentum`` (when set) for async, else ``momentum``."""
        if mode == "async" and self.async_momentum is not None:
            return self.async_momentum
        return self.momentum

    def __post_init__(self):
        from gradcomp.localsgd import OUTER_OPTIMIZERS, check_schedule

        for name in ("workers", "steps", "batch_size", "eval_every"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if (isinstance(self.dgc_warmup_epochs, bool) or not isinstance(self.dgc_warmup_epochs, (int, float))
                or not 0 <= self.dgc_warmup_epochs <= MAX_WARMUP_EPOCHS):
            raise ValueError(f"dgc_warmup_epochs must be a number of epochs in [0, {MAX_WARMUP_EPOCHS:g}], "
                             f"got {self.dgc_warmup_epochs!r}")
        if self.async_momentum is not None and not 0 <= self.async_momentum < 1:
            raise ValueError(f"async_momentum must be None or in [0, 1), got {self.async_momentum!r}")
        if self.auto_link is not None:
            from gradcomp.adaptive import Adaptive

            Adaptive(link=self.auto_link)  # raises for a bad prior, naming it
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.sparse_algorithm not in SPARSE_ALGORITHMS:
            raise ValueError(f"sparse_algorithm must be one of {SPARSE_ALGORITHMS}, got {self.sparse_algorithm!r}")
        if (isinstance(self.ranks_per_host, bool) or not isinstance(self.ranks_per_host, int)
                or self.ranks_per_host < 1 or self.workers % self.ranks_per_host):
            raise ValueError(f"ranks_per_host must be an int >= 1 dividing workers ({self.workers}), "
                             f"got {self.ranks_per_host!r}")
        if self.threshold is not None and not self.threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold!r}")
        if not 0 < self.timeout <= MAX_TIMEOUT:
            # the launcher allows timeout x compressors (<= 8) seconds, at most 1e9
            raise ValueError(f"timeout must be > 0 and <= {MAX_TIMEOUT:g} seconds (finite), "
                             f"got {self.timeout!r}")

        if self.straggler is not None:
            rank, factor = self.straggler
            if not (isinstance(rank, int) and 0 <= rank < self.workers):
                raise ValueError(f"straggler rank must be a worker in 0..{self.workers - 1}, got {rank!r}")
            if not 1 <= factor < 1e3:
                raise ValueError(f"straggler factor must be >= 1 (and < 1000), got {factor!r}")
        if (isinstance(self.straggler_from_s, bool) or not isinstance(self.straggler_from_s, (int, float))
                or not 0 <= self.straggler_from_s < float("inf")):
            raise ValueError(f"straggler_from_s must be a finite number of seconds >= 0, "
                             f"got {self.straggler_from_s!r}")
        if self.backup_workers is not None and (isinstance(self.backup_workers, bool) or not isinstance(
                self.backup_workers, int) or not 0 <= self.backup_workers < self.workers):
            raise ValueError(f"backup_workers must be None or an int in [0, workers={self.workers}), "
                             f"got {self.backup_workers!r}")
        if (isinstance(self.ft_timeout, bool) or not isinstance(self.ft_timeout, (int, float))
                or not 0 < self.ft_timeout <= 60):
            raise ValueError(f"ft_timeout must be a number of seconds in (0, 60], got {self.ft_timeout!r}")
        if self.label_skew is not None:
            from gradcomp.lab.study.data import check_label_skew

            check_label_skew(self.label_skew)
        if not 0 <= self.compute_jitter <= 10:
            raise ValueError(f"compute_jitter must be a CV in [0, 10], got {self.compute_jitter!r}")
        check_schedule(self.sync_every, self.fragments, self.overlap)
        from gradcomp.sync_period import SyncPeriod

        # raises for bad bounds or rules, naming them
        SyncPeriod(self.min_sync_every, self.max_sync_every, comm_share=self.comm_share, period_cost=self.period_cost)
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.outer not in OUTER_OPTIMIZERS:
            raise ValueError(f"outer must be one of {OUTER_OPTIMIZERS}, got {self.outer!r}")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        d["straggler"] = list(self.straggler) if self.straggler is not None else None
        return d
