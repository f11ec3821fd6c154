"""A latency-bandwidth (alpha-beta) model of one data-parallel training step.

Sources: the alpha-beta (Hockney) cost model and its use for collectives in
Thakur, Rabenseifner and Gropp 2005 ("Optimization of collective
communication operations in MPICH"); the bandwidth-optimal ring of Patarasuk
and Yuan 2009; bucketed overlap as in PyTorch DDP (Li et al. 2020); the
parameter server of Li et al. 2014; the pipeline bubble of GPipe (Huang et
al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021).

**One allreduce** of a bucket (ring, two-phase, halving-doubling, sparse allgather,
sparse reduce-scatter: :mod:`gradcomp.lab.plan.costs`; hierarchical, on hosts of
``local_ranks`` ranks: :mod:`gradcomp.lab.plan.tiers`): alpha-beta messages on one
port (a host's link), exact wire sizes, kernel time from measured rates.

**Overlap with backward.** The gradient is cut into DDP's buckets (the first
1 MiB, then 25 MiB of float32 by default; buckets under the hook's
``min_compress_numel`` go uncompressed as float32). Backward takes
``backward_share`` of the compute time and produces gradient bytes at a
constant rate, so bucket ``i`` is ready once backward has produced its
elements; the hook's one thread reduces buckets in FIFO order:
``end_i = max(ready_i, end_(i-1)) + allreduce_i``. The *exposed*
communication is ``max(0, end_last - compute)``.

**Stragglers.** Each worker's compute is its mean (``compute_s``, a
straggler's ``factor`` times it) times a lognormal factor of mean 1 and
coefficient of variation ``cv``; a synchronous step starts its last bucket
when the slowest worker is done, so the compute part is
``E[max_i]`` (:func:`gradcomp.lab.plan.lognormal.expected_max`) and a worker's
wait is ``E[max] - its mean``. ``idle_share`` = the workers' mean wait /
step time (the time study's ``wait / step time``, averaged over workers).

**Parameter server** (:mod:`gradcomp.ps`; ``S`` server shards holding ``n / S``
elements each): a worker's step is compute, compress, push (to each shard:
one ZeroMQ message: an 80-byte header frame + a bundle of payloads, each
frame with its ZMTP frame header; a header-only reply), the server's work,
pull (request header; reply header + a full float32 or a compressed delta
bundle), decompress: ``6 S`` messages. A server receives one push shard from
every worker, so in a synchronous round its ingress ``N push_shard / beta``
and its egress ``N pull_shard / beta`` are the bottleneck once ``N > S``.
Asynchronously each push is applied on arrival. A worker's cycle is its
time away from the server ``Z`` (compute, compress, messages, its own
transfers, decompress) plus its response time ``R`` at the server, whose
service per push is ``D = max(push_shard / beta, pull_shard / beta, busy)``
(``busy``: decompress-add and optimizer step of a shard, plus the pull's
compression). The workers and the server form a closed queueing network,
solved by exact mean value analysis (:func:`mva_response`; Reiser and
Lavenberg 1980): ``R = D (1 + Q)`` with ``Q`` the mean number of pushes
ahead, so the throughput ``X = sum_i 1 / (Z_i + R_i)`` tends to ``1 / D``
when the server saturates and to ``sum_i 1 / (Z_i + D)`` when it idles.
The time queued behind other pushes, ``R - D``, is the worker's wait (its
busy share ``busy / D`` of it: the time study counts only queueing behind
the server's work as wait, queueing for its link as communication). Mean
staleness (updates by others between a worker's pull and its push being
applied) = ``(X - 1 / cycle) * (cycle - pull)``.

**Kernel calls.** A codec op on ``m`` elements costs ``call_s + m / rate``
(:meth:`Profile.seconds`): the fixed per-call cost (dispatch, allocation,
Python) matters for the parameter server, which compresses every parameter
tensor separately (``tensors`` calls per push, each of ``n / tensors``
elements), where DDP's hook compresses one flat bucket.

**Shared host** (:class:`~gradcomp.lab.plan.host.Host`, ``Setting.host`` with
``ranks_per_host`` processes on ``cores`` cores, and ``background_load``
runnable processes of other jobs, as when the time study's workers, and in
async the server, share a few cores with other work). Processor sharing: codec
kernels and the server's work take ``share = max(1, runnable / cores)``
times their one-core time. A collective's exchange step waits for a
descheduled peer, ``skew = slice_s (share - 1)``, which overlaps the
transfer: a step costs ``alpha + max(skew, bytes / beta)``; with a
straggler the others wait idle inside the collective when it hands off, so
no step waits (skew 0); the parameter server never computes on its own, so
its exchanges have none either (its delays are the queue and the shared
core). The ranks' hand-offs scatter under time sharing: a compute CV of
``sched_cv (share - 1)``, combined with the configured one in quadrature,
enters the lognormal maximum. A straggler's emulated delay is a sleep: in
async its share of the straggler's cycle frees a core (runnable
``ranks_per_host - sleep / cycle``, solved with the cycles by fixed-point
iteration). Without a host (one rank per node, as in every projection)
all of this is 1 and 0, and the model is the plain alpha-beta one.

**Pipeline.** ``p`` stages, ``m`` micro-batches per step: GPipe and 1F1B
both take ``(m + p - 1)`` micro-batch slots for ``m`` micro-batches of work,
a bubble fraction of ``(p - 1) / (m + p - 1)``; 1F1B keeps at most ``p``
micro-batches' activations alive where GPipe keeps ``m``.

Not modelled (stated so that a disagreement with a measurement can be
traced): contention between the hook's compression and the same rank's
backward (one bucket per step in the time study: nothing to overlap), the
ring's progress before a late straggler arrives, the parameter-server
worker's own per-tensor bookkeeping beyond its codec calls (what it costs:
docs/results/plan-validation.md), network congestion beyond
one link per node (a non-blocking fabric is assumed), the agreement message
of the first call, and zeroing / dividing the allgather's output.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from gradcomp.lab.plan.codecs import CODEC_NAMES, CODECS, GAP_PTS, GAP_UNMEASURED, PLAN_NAMES, PlanCodec, plan_codec
from gradcomp.lab.plan.costs import (ALLREDUCE_ALGORITHMS, SIZE_NBYTES, allreduce_bytes, allreduce_messages,
                                     allreduce_seconds, compress_s, decompress_add_s, quantizations,
                                     wire_nbytes)
from gradcomp.lab.plan.host import Host
from gradcomp.lab.plan.tiers import hierarchical_seconds, hierarchical_sent, intra_tier
from gradcomp.lab.plan.lognormal import expected_max
from gradcomp.lab.plan.profile import Profile
from gradcomp.lab.plan.ps_queue import mva_response
from gradcomp.pipeline.bubble import bubble_fraction
from gradcomp.ps import protocol as _ps_protocol

__all__ = [
    "PlanCodec", "CODECS", "CODEC_NAMES", "PLAN_NAMES", "GAP_PTS", "GAP_UNMEASURED", "ALGORITHMS", "MODES",
    "Setting", "Prediction",
    "plan_codec", "bucket_sizes", "allreduce_bytes", "allreduce_seconds", "allreduce_messages",
    "quantizations", "ps_bytes", "predict",
    "sync_step", "ps_sync_step", "async_throughput", "mva_response", "bubble_fraction", "FORWARD_SHARE",
    "pipeline_step",
    "PS_HEADER_NBYTES", "SIZE_NBYTES", "DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES",
    "MIN_COMPRESS_NUMEL",
]

#: a parameter-server message without data on the wire: the 80-byte header frame
#: plus its ZMTP frame header (:func:`gradcomp.ps.protocol.message_nbytes`)
PS_HEADER_NBYTES = _ps_protocol.message_nbytes()
#: DDP's bucket_cap_mb default (25 MiB) and its first bucket (1 MiB)
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
#: gradcomp.ddp.DEFAULT_MIN_COMPRESS_NUMEL: smaller buckets go uncompressed
MIN_COMPRESS_NUMEL = 16384

#: every algorithm :func:`predict` takes: the flat allreduces, the two-tier one, the parameter server
ALGORITHMS = (*ALLREDUCE_ALGORITHMS, "hierarchical", "ps")
MODES = ("sync", "async")




# ---- bytes per step -------------------------------------------------------------

def ps_bytes(c: PlanCodec, numel: int, servers: int, tensors: int = 1, compress_pull: bool = True) -> dict:
    """Bytes one worker moves per step with the parameter server.

    The gradient of ``numel`` elements in ``tensors`` equal parameter tensors
    is split over ``servers`` shards (whole tensors, balanced; at least one per
    server). Push: per shard a message (:data:`PS_HEADER_NBYTES` and a data
    frame: a bundle ``8 + 8 count`` bytes of sizes and each tensor's payload,
    plus its ZMTP frame header); reply: a header-only message. Pull: a
    header-only request and a reply with a bundle of full float32 payloads or
    (``compress_pull``) compressed deltas.

    Returns:
        ``{"push": bytes sent, "pull": bytes received, "push_shard": largest
        shard push, "pull_shard": largest shard pull, "sent": all sent,
        "received": all received}``.
    """
    tensors = max(tensors, servers)
    per = -(-numel // tensors)
    counts = [tensors // servers + (1 if s < tensors % servers else 0) for s in range(servers)]
    raw = CODECS["none"]
    push = [_ps_protocol.message_nbytes(8 + 8 * k + k * wire_nbytes(c, per)) for k in counts]
    pull = [_ps_protocol.message_nbytes(8 + 8 * k + k * wire_nbytes(c if compress_pull else raw, per))
            for k in counts]
    sent = sum(push) + servers * PS_HEADER_NBYTES  # + pull requests
    received = sum(pull) + servers * PS_HEADER_NBYTES  # + push replies
    return {"push": sum(push), "pull": sum(pull), "push_shard": max(push), "pull_shard": max(pull),
            "sent": sent, "received": received}


def bucket_sizes(params: int, bucket_bytes: int = DDP_BUCKET_BYTES,
                 first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES) -> list[int]:
    """DDP's bucket sizes in float32 elements for ``params`` elements, in the
    order backward produces them (first bucket ``first_bucket_bytes``, then
    ``bucket_bytes`` each, the last one the remainder)."""
    first = max(1, first_bucket_bytes // 4)
    size = max(1, bucket_bytes // 4)
    out = [min(params, first)]
    left = params - out[0]
    while left > 0:
        out.append(min(size, left))
        left -= out[-1]
    return out


# ---- the step -----------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """What a prediction is about.

    Attributes:
        nodes: data-parallel workers N (>= 1).
        link_bytes_per_s: each node's link, bytes per second.
        params: model parameters (float32 gradient elements).
        compute_s: one worker's mean forward + backward time per step, seconds.
        straggler_cv: coefficient of variation of every worker's compute time.
        straggler_factor: one worker's compute takes this many times as long (>= 1).
        apply_s: optimizer step time per step (None: ``sgd.apply`` rate of the profile).
        backward_share: share of ``compute_s`` spent in backward (overlappable).
        bucket_bytes / first_bucket_bytes: DDP bucket caps.
        min_compress_numel: buckets under it go uncompressed (gradcomp.ddp).
        servers: parameter-server shards S; tensors: parameter tensors (PS bundles).
        compress_pull: the PS sends compressed deltas on pull.
        alpha_s: message latency override (None: the profile's).
        host: the cores the ranks share (:class:`~gradcomp.lab.plan.host.Host`);
            None: every rank has a core to itself (no processor-sharing terms).
        ranks_per_host: processes of the job on one host (workers, plus the
            parameter server where it shares their host): the runnable
            processes :class:`~gradcomp.lab.plan.host.Host` divides the cores among.
        background_load: mean runnable processes of other jobs on the host
            (e.g. its load average before the job started); they share the
            cores too (>= 0).
        local_ranks: ``R`` ranks per host of a two-tier cluster (``nodes`` =
            hosts x R, a divisor of ``nodes``): a host's ranks reach each other
            over the intra-host tier and share the host's link
            (``link_bytes_per_s``) to the other hosts; 1: a link per rank.
        intra_alpha_s / intra_bytes_per_s: the intra-host tier's message
            latency and bytes per second (None: the profile's ``intra``, else free).
    """

    nodes: int
    link_bytes_per_s: float
    params: int
    compute_s: float
    straggler_cv: float = 0.0
    straggler_factor: float = 1.0
    apply_s: float | None = None
    backward_share: float = 2.0 / 3.0
    bucket_bytes: int = DDP_BUCKET_BYTES
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES
    min_compress_numel: int = MIN_COMPRESS_NUMEL
    servers: int = 1
    tensors: int = 1
    compress_pull: bool = True
    alpha_s: float | None = None
    host: Host | None = None
    ranks_per_host: int = 1
    background_load: float = 0.0
    local_ranks: int = 1
    intra_alpha_s: float | None = None
    intra_bytes_per_s: float | None = None

    def __post_init__(self):
        for name in ("nodes", "params", "servers", "tensors", "ranks_per_host", "local_ranks"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {val!r}")
        for name in ("link_bytes_per_s", "compute_s"):
            val = getattr(self, name)
            if not (isinstance(val, (int, float)) and math.isfinite(val) and val > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {val!r}")
        if not (math.isfinite(self.straggler_cv) and self.straggler_cv >= 0):
            raise ValueError(f"straggler_cv must be a finite number >= 0, got {self.straggler_cv!r}")
        if not (math.isfinite(self.straggler_factor) and self.straggler_factor >= 1):
            raise ValueError(f"straggler_factor must be a finite number >= 1, got {self.straggler_factor!r}")
        if not (math.isfinite(self.background_load) and self.background_load >= 0):
            raise ValueError(f"background_load must be a finite number >= 0, got {self.background_load!r}")
        if self.nodes % self.local_ranks:
            raise ValueError(f"local_ranks must divide nodes ({self.nodes}), got {self.local_ranks}")
        for name in ("intra_alpha_s", "intra_bytes_per_s"):
            val = getattr(self, name)
            if val is not None and not (isinstance(val, (int, float)) and math.isfinite(val) and val > 0):
                raise ValueError(f"{name} must be None or a finite number > 0, got {val!r}")
        if not 0 <= self.backward_share <= 1:
            raise ValueError(f"backward_share must be in [0, 1], got {self.backward_share!r}")

    def alpha(self, prof: Profile) -> float:
        return prof.alpha_s if self.alpha_s is None else self.alpha_s

    def intra(self, prof: Profile) -> tuple[float, float]:
        """``(alpha, bytes per second)`` of the intra-host tier (:func:`~gradcomp.lab.plan.tiers.intra_tier`)."""
        return intra_tier(prof, self.intra_alpha_s, self.intra_bytes_per_s)

    @property
    def runnable(self) -> float:
        """Processes competing for the host's cores: the job's and the background."""
        return self.ranks_per_host + self.background_load

    def share(self, runnable: float | None = None) -> float:
        """CPU slowdown with ``runnable`` processes on the host (default: :attr:`runnable`)."""
        return 1.0 if self.host is None else self.host.share(self.runnable if runnable is None else runnable)

    def skew_s(self, runnable: float | None = None) -> float:
        """Scheduling delay of one exchange step (0 without a host)."""
        return 0.0 if self.host is None else self.host.skew_s(self.runnable if runnable is None else runnable)

    def compute_cv(self) -> float:
        """CV of the workers' compute: the configured jitter and the host's hand-off
        scatter, ``sqrt(straggler_cv^2 + host_cv^2)``."""
        host_cv = 0.0 if self.host is None else self.host.cv(self.runnable)
        return math.hypot(self.straggler_cv, host_cv)


@dataclass
class Prediction:
    """A predicted step (seconds unless stated; per worker, averaged over workers).

    ``step_s`` = time per step (async: a worker's time per push);
    ``compute_s`` = the workers' mean compute; ``compress_s`` = codec kernel
    time not hidden behind a transfer; ``communicate_s`` = the collectives'
    (or push + pull's) total time, ``exposed_comm_s`` the part not hidden
    behind backward; ``wait_s`` = mean wait for the slowest worker (async: for
    a saturated server); ``apply_s`` = optimizer step; ``idle_share`` =
    ``wait_s / step_s``; ``comm_share`` = exposed communication (with the
    kernel time inside it) / step; ``throughput`` = gradients applied per
    second (``N / step`` for sync, pushes per second for async);
    ``bytes_sent`` / ``bytes_received`` per worker per step;
    ``staleness_mean`` for async only; ``notes`` e.g. ``"server-bound"``.
    """

    mode: str
    compressor: str
    algorithm: str
    nodes: int
    step_s: float
    compute_s: float
    compress_s: float
    communicate_s: float
    exposed_comm_s: float
    wait_s: float
    apply_s: float
    idle_share: float
    comm_share: float
    throughput: float
    bytes_sent: int
    bytes_received: int
    staleness_mean: float | None = None
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _compute_times(s: Setting) -> tuple[float, float]:
    """(expected slowest compute, workers' mean compute) per step."""
    n = s.nodes
    if s.straggler_factor > 1 and n > 1:
        groups = {s.compute_s: n - 1, s.compute_s * s.straggler_factor: 1}
        mean = s.compute_s * (n - 1 + s.straggler_factor) / n
    else:
        groups = {s.compute_s: n}
        mean = s.compute_s
    cv = s.compute_cv()
    slowest = expected_max(groups, cv) if (cv > 0 or len(groups) > 1) else s.compute_s
    return slowest, mean


def _apply_s(s: Setting, prof: Profile, elements: int) -> float:
    """Optimizer step over ``elements`` (a given ``apply_s`` is for all ``params``)."""
    if s.apply_s is not None:
        return s.apply_s * elements / s.params
    return prof.seconds("sgd.apply", elements)


def sync_step(c: PlanCodec, algorithm: str, s: Setting, prof: Profile) -> Prediction:
    """Synchronous data-parallel step with gradcomp's DDP hook (any allreduce
    algorithm of :data:`ALGORITHMS` but ``ps``): buckets reduced in FIFO order
    as backward produces them, behind the slowest worker."""
    if algorithm not in c.algorithms or algorithm == "ps":
        raise ValueError(f"algorithm for {c.name} must be one of {c.algorithms[:-1]}, got {algorithm!r}")
    alpha, beta, n = s.alpha(prof), s.link_bytes_per_s, s.nodes
    per, intra = s.local_ranks, s.intra(prof)
    slowest, mean = _compute_times(s)
    backward = s.backward_share * slowest
    forward = slowest - backward
    done, produced = 0.0, 0
    sent = received = 0
    kernel_total = comm_total = 0.0
    raw = CODECS["none"]
    # a straggler hands off last, after the others have blocked in the collective:
    # their cores are idle, so no exchange step waits for a descheduled peer
    skew = 0.0 if s.straggler_factor > 1 else s.skew_s()
    priced: dict[int, tuple] = {}  # bucket size -> (seconds, sent, received): DDP's buckets repeat sizes
    for size in bucket_sizes(s.params, s.bucket_bytes, s.first_bucket_bytes):
        produced += size
        ready = forward + backward * produced / s.params
        bc, balg = (c, algorithm) if size >= s.min_compress_numel else (raw, "ring")
        if size not in priced and balg == "hierarchical":  # exact inside a host, compressed across hosts
            priced[size] = (hierarchical_seconds(bc, size, n // per, per, prof, share=s.share(), alpha_s=alpha,
                                                 beta_bytes_per_s=beta, intra=intra, skew=skew),
                            hierarchical_sent(bc, size, n // per, per), 0)
        elif size not in priced:
            priced[size] = (allreduce_seconds(bc, balg, size, n, alpha, beta, prof, s.share(), skew, per, intra),
                            *allreduce_bytes(bc, balg, size, n))
        t, b_sent, b_recv = priced[size]
        sent, received = sent + b_sent, received + b_recv
        kernel_total += t["kernel"]
        comm_total += t["total"]
        done = max(ready, done) + t["total"]
    apply = _apply_s(s, prof, s.params)
    exposed = max(0.0, done - slowest)
    step = slowest + exposed + apply
    wait = slowest - mean
    comm_share = exposed / step
    return Prediction("sync", c.name, algorithm, n, step, mean, kernel_total, comm_total, exposed, wait, apply,
                      wait / step, comm_share, n / step, sent, received)


def _ps_parts(c: PlanCodec, s: Setting, prof: Profile, runnable: float | None = None) -> dict:
    """Per-step parts of a parameter-server worker and shard server, with
    ``runnable`` processes sharing the host (default: all of them): kernel
    times stretched by :meth:`Setting.share`. No scheduling delay
    (:meth:`Setting.skew_s`): the server computes nothing of its own, so it is
    never descheduled behind its own work; it is busy serving other pushes
    (the queue of :func:`mva_response`) on a shared core (``share``)."""
    alpha, beta = s.alpha(prof), s.link_bytes_per_s
    share = s.share(runnable)
    b = ps_bytes(c, s.params, s.servers, s.tensors, s.compress_pull)
    shard = -(-s.params // s.servers)
    # the codec runs once per parameter tensor (ps_bytes' equal tensors, whole
    # tensors per shard): each call pays the op's per-call cost
    tensors = max(s.tensors, s.servers)
    per = -(-s.params // tensors)
    per_shard = -(-tensors // s.servers)
    compress = tensors * compress_s(c, prof, per, c.error_feedback)
    pull_codec = c if s.compress_pull else CODECS["none"]
    decompress = tensors * decompress_add_s(pull_codec, prof, per)
    # per push a server decompress-adds the shard and (compress_pull) compresses the
    # pusher's delta with its residual; it applies the optimizer once per update
    per_push = per_shard * (decompress_add_s(c, prof, per)
                            + (compress_s(c, prof, per, True) if s.compress_pull else 0.0))
    apply = _apply_s(s, prof, shard)
    return {"bytes": b, "compress": share * compress, "decompress": share * decompress,
            "per_push": share * per_push, "apply": share * apply, "latency": 6 * s.servers * alpha,
            "push": b["push"] / beta, "pull": b["pull"] / beta,
            "push_shard": b["push_shard"] / beta, "pull_shard": b["pull_shard"] / beta, "alpha": alpha}


def ps_sync_step(c: PlanCodec, s: Setting, prof: Profile) -> Prediction:
    """Synchronous parameter-server step: every worker pushes, each shard
    server aggregates the N pushes (ingress ``N push_shard / beta``), applies
    one step and answers the N pulls (egress ``N pull_shard / beta``)."""
    n = s.nodes
    parts = _ps_parts(c, s, prof)
    slowest, mean = _compute_times(s)
    push = max(parts["push"], n * parts["push_shard"])
    pull = max(parts["pull"], n * parts["pull_shard"])
    comm = parts["latency"] + push + pull + n * parts["per_push"]  # the server's work on the N pushes
    kernels = parts["compress"] + parts["decompress"]
    step = slowest + comm + parts["apply"] + kernels
    wait = slowest - mean
    b = parts["bytes"]
    return Prediction("sync", c.name, "ps", n, step, mean, kernels, comm, comm, wait, parts["apply"],
                      wait / step, (comm + kernels) / step, n / step, b["sent"], b["received"])


def async_throughput(c: PlanCodec, s: Setting, prof: Profile) -> Prediction:
    """Asynchronous parameter server: pushes applied on arrival (see the module docstring).

    ``step_s`` is a worker's mean time per push (``N / X``), ``throughput`` the
    pushes applied per second ``X``, ``wait_s`` the time a worker queues for
    a saturated server, ``staleness_mean`` the mean number of other workers'
    updates applied between a worker's pull and its push.

    On a shared host (:attr:`Setting.host`) a straggler's emulated delay is
    a sleep: for that share of its cycle it is not runnable and the others'
    kernels and the server run faster. The runnable count
    ``ranks_per_host + background_load - sleep / straggler_cycle`` and the cycles are solved
    together by fixed-point iteration.
    """
    n = s.nodes
    workers = [s.compute_s] * n
    if s.straggler_factor > 1:
        workers[-1] = s.compute_s * s.straggler_factor  # lognormal jitter averages out: mean 1
    sleep = workers[-1] - s.compute_s
    runnable = s.runnable
    for _ in range(50):
        parts = _ps_parts(c, s, prof, runnable)
        busy = parts["per_push"] + parts["apply"]  # a server's time per push
        demand_s = max(parts["push_shard"], parts["pull_shard"], busy)  # the server's time per push
        fixed = parts["compress"] + parts["latency"] + parts["push"] + parts["pull"] + busy + parts["decompress"]
        think = [w + fixed - demand_s for w in workers]
        groups = [(n - 1, think[0]), (1, think[-1])] if n > 1 and s.straggler_factor > 1 else [(n, think[0])]
        per_group = mva_response(groups, demand_s)
        resp = [per_group[0]] * (n - 1) + [per_group[-1]]
        cycles = [z + r for z, r in zip(think, resp)]
        nxt = s.runnable - sleep / cycles[-1]
        if abs(nxt - runnable) < 1e-9:
            break
        runnable = nxt
    x = sum(1.0 / t for t in cycles)
    mean_cycle = sum(cycles) / n
    # queued behind the server's work (its busy share of the service): the
    # time study's wait; queueing for the server's link stays communication
    wait = sum(r - demand_s for r in resp) / n * min(1.0, busy / demand_s)
    pull_part = parts["pull"] + parts["decompress"] + 3 * s.servers * parts["alpha"]
    stale = sum((x - 1.0 / t) * (t - pull_part) for t in cycles) / n
    comm = parts["latency"] + parts["push"] + parts["pull"]
    b = parts["bytes"]
    mean_compute = sum(workers) / n
    notes = ["server-bound"] if x * demand_s > 0.9 else []
    return Prediction("async", c.name, "ps", n, mean_cycle, mean_compute, parts["compress"] + parts["decompress"],
                      comm, comm, wait, parts["apply"], wait / mean_cycle,
                      (comm + wait + parts["compress"] + parts["decompress"]) / mean_cycle, x,
                      b["sent"], b["received"], stale, notes)


def predict(mode: str, compressor: str, algorithm: str, s: Setting, prof: Profile) -> Prediction:
    """The step of ``mode`` (``sync``/``async``) with ``compressor`` (a :data:`CODECS`
    name or a :class:`PlanCodec`) and ``algorithm`` (one of :data:`ALGORITHMS`:
    ``ring``, ``two_phase``, ``allgather``, ``halving_doubling``,
    ``sparse_reduce_scatter`` or ``ps``; async is always ``ps``).

    Raises:
        ValueError: an unknown mode, compressor or algorithm, or a combination
            the library rejects (a sparse codec on a dense algorithm, ...).
    """
    c = compressor if isinstance(compressor, PlanCodec) else plan_codec(compressor)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if algorithm not in c.algorithms:
        raise ValueError(f"algorithm for {c.name} must be one of {c.algorithms}, got {algorithm!r}")
    if mode == "async":
        if algorithm != "ps":
            raise ValueError(f"async mode runs on the parameter server: algorithm must be 'ps', got {algorithm!r}")
        return async_throughput(c, s, prof)
    if algorithm == "ps":
        return ps_sync_step(c, s, prof)
    return sync_step(c, algorithm, s, prof)


# ---- pipeline ----------------------------------------------------------------------

#: share of a step's compute that is forward (backward: the rest, about twice the forward)
FORWARD_SHARE = 1.0 / 3.0


def pipeline_step(compute_s: float, stages: int, microbatches: int, schedule: str = "gpipe",
                  boundary_s: float = 0.0) -> dict:
    """One pipeline-parallel step of a replica whose un-split compute takes ``compute_s``.

    Each stage does ``compute_s / p`` of work, in ``m`` micro-batches:
    forwards of ``f = FORWARD_SHARE * compute_s / (p m)`` and backwards of
    ``g = (1 - FORWARD_SHARE) * compute_s / (p m)``. Each of the ``p - 1``
    boundaries carries a micro-batch's activations forward and its gradients
    backward in ``boundary_s`` together (``boundary_s / 2`` each way; links are
    full duplex). The forward pass and the backward pass are each a flow shop
    of ``m`` identical jobs through ``p`` stages and ``p - 1`` links, which
    takes the sum of one job's service times plus ``m - 1`` times the slowest::

        T_f = p f + (p - 1) b/2 + (m - 1) max(f, b/2)
        T_b = p g + (p - 1) b/2 + (m - 1) max(g, b/2)      step = T_f + T_b

    With ``boundary_s = 0`` this is GPipe's ``(m + p - 1)`` slots of
    ``compute_s / (p m)`` (Huang et al. 2019); when the link is slower than a
    stage's compute the link's ``m`` transfers set the pace instead. 1F1B
    (Narayanan et al. 2019) is given the same step (it reorders, it does not
    remove work); it keeps fewer micro-batches' activations alive.

    Returns:
        ``{"step_s", "bubble", "efficiency", "peak_microbatches"}``: ``bubble`` is
        the share of the step a stage is not computing, ``1 - (compute_s / p) /
        step_s`` (``(p - 1) / (m + p - 1)`` without boundary time);
        ``efficiency = 1 - bubble``; activations alive per stage, ``m`` for
        GPipe, ``min(p, m)`` for 1F1B.

    Raises:
        ValueError: unknown schedule or bad counts.
    """
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    bubble_fraction(stages, microbatches)  # validates the counts
    p, m = stages, microbatches
    f = FORWARD_SHARE * compute_s / (p * m)
    g = (1.0 - FORWARD_SHARE) * compute_s / (p * m)
    half = boundary_s / 2.0 if p > 1 else 0.0
    step = sum(p * t + (p - 1) * half + (m - 1) * max(t, half) for t in (f, g))
    bubble = 1.0 - (compute_s / p) / step if step > 0 else 0.0
    return {"step_s": step, "bubble": bubble, "efficiency": 1.0 - bubble,
            "peak_microbatches": m if schedule == "gpipe" else min(p, m)}
