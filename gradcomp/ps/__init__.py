"""Parameter server: compressed push and pull, sync and async, bounded staleness.

Ranks ``[0, num_servers)`` of a torch.distributed group are servers,
the other ranks workers (Li et al. 2014, "Scaling Distributed Machine
Learning with the Parameter Server"). Parameters are placed whole on the
servers, balanced by bytes (greedy largest-first). Workers push gradients
compressed by any gradcomp compressor (dense or sparse) with error feedback
per parameter and pull parameters: full float32, or (``compress_pull``)
compressed deltas with a residual per worker kept on the server, so each
replica tracks the server without drift. Workers may compute on a GPU: only
the compressed payload bytes move to the host.

Modes:
    ``"sync"``: one averaged optimizer step per round of pushes from all live
        workers (data-parallel SGD through a central optimizer).
    ``"async"``: each push is applied on arrival; ``max_staleness`` drops pushes
        computed from parameters more than that many versions old (Ho et al.
        2013, stale synchronous parallel); ``staleness_lr`` scales the
        learning rate by ``1 / (1 + staleness)`` (Zhang et al. 2016).

Transport: ZeroMQ (pyzmq), as in ps-lite and BytePS: one ROUTER socket per
server, a DEALER per worker and server (:mod:`gradcomp.ps.transport`). The
library frames every message (a receiver never sizes a buffer from a peer's
header) and keeps a queue per peer with a high-water mark; the server never
blocks on one worker. torch.distributed only carries the servers' addresses
and the job's credential when the roles are built (servers bind the interface
that routes to ``$MASTER_ADDR``, or ``$GRADCOMP_PS_HOST``, or ``address``);
every connection proves a worker rank with it at the ZeroMQ handshake.

Failures: a worker whose heartbeats stop (``heartbeat_timeout``), that makes
no request for ``worker_timeout`` seconds, does not read its replies or breaks
the protocol is declared dead, alone; the run goes on without it
(``on_worker_failure="continue"``) or the server raises
:class:`WorkerFailedError` naming its rank and the other workers get
:class:`PSAbortedError` (``"fail"``). Malformed pushes are rejected and
counted. A worker restarted with its rank, ``server_addresses`` and the
``credential`` takes its place once the old process is gone, or as a newer
``incarnation``. Servers checkpoint atomically (``checkpoint_dir``,
``checkpoint_every``) and resume with ``resume=True``; a checkpoint that
cannot be resumed raises :class:`CheckpointError`.

Accounting: every rank's :class:`~gradcomp.TrafficMeter` counts what ZeroMQ
puts on the connection for each message (80-byte header, payload bundle, ZMTP
frame headers) in phases ``"connect"``, ``"push"`` and ``"pull"`` (DONE
included), with uncompressed float32 equivalents; heartbeats apart
(``heartbeat_meter``). :meth:`ParameterServer.stats` adds per-worker counts.

High-level API (one call per rank)::

    import functools, torch
    import gradcomp as gc
    from gradcomp import ps
    from gradcomp.launch import launch

    config = ps.PSConfig(mode="async", steps=500, num_servers=1,
                         compressor=gc.TopK(0.01, values=gc.Int8Quantizer()),
                         compress_pull=True, max_staleness=8, staleness_lr=True,
                         optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    # model_fn() -> nn.Module (float32); loss_fn(model, step, worker_index) -> scalar loss
    def rank_main(rank, world_size):          # module-level, so that it pickles
        out = ps.run(rank, world_size, model_fn, loss_fn, config)
        return {"stats": out["stats"], "losses": out.get("losses")}  # no tensors through launch
    results = launch(rank_main, 1 + 4)
    server_stats = results[0]["stats"]

``ps.run(rank, world_size, model_fn, loss_fn, config, on_step=None)`` returns,
on a server, ``{"role": "server", "rank", "stats", "params"}`` and, on a worker,
``{"role": "worker", "rank", "losses", "stats", "params"}``.

Roles by hand::

    if rank < num_servers:
        server = ps.ParameterServer(model, mode="sync", num_servers=num_servers,
                                    optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        stats = server.serve()               # until every worker is done or dead
    else:
        worker = ps.Worker(model, num_servers=num_servers, compressor=gc.Int8Quantizer())
        with worker:                         # sends DONE at the end
            for batch in batches:
                worker.pull()                # replica (the model's parameters) updated in place
                model.zero_grad(); loss_fn(model, batch).backward()
                result = worker.push()       # PushResult: accepted / dropped / rejected
            worker.pull()

Modules: :mod:`~gradcomp.ps.run` (``PSConfig``, ``run``, ``role``),
:mod:`~gradcomp.ps.worker`, :mod:`~gradcomp.ps.server` (the server's message
loop), :mod:`~gradcomp.ps.apply` (its update rule), :mod:`~gradcomp.ps.membership`
(who holds a rank, failure detection), :mod:`~gradcomp.ps.auth`,
:mod:`~gradcomp.ps.gatekeeper`, :mod:`~gradcomp.ps.checkpoint`,
:mod:`~gradcomp.ps.protocol` (messages), :mod:`~gradcomp.ps.transport`
(ZeroMQ sockets), :mod:`~gradcomp.ps.sharding` (placement).

With torchrun (a least-squares demo; prints the server's stats as JSON)::

    torchrun --nproc_per_node=3 -m gradcomp.ps --mode async --compressor int8 --compress-pull
    python -m gradcomp.ps --world-size 3 ...   # the same on local processes (gradcomp.launch)
"""

from __future__ import annotations

from gradcomp._lazy import lazy_attributes
from gradcomp.ps.auth import new_credential
from gradcomp.ps.errors import (CheckpointError, PeerError, ProtocolError, PSAbortedError, PSError,
                                RankConflictError, WorkerFailedError)
from gradcomp.ps.run import PSConfig, role, run
from gradcomp.ps.sharding import ParamSpec, shard_parameters

# the roles load pyzmq on first use, so that `import gradcomp` stays light
_LAZY = {"ParameterServer": "gradcomp.ps.server", "PushResult": "gradcomp.ps.worker",
         "Worker": "gradcomp.ps.worker"}
__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)

__all__ = [
    "ParameterServer",
    "Worker",
    "PushResult",
    "PSConfig",
    "run",
    "role",
    "new_credential",
    "shard_parameters",
    "ParamSpec",
    "PSError",
    "PeerError",
    "RankConflictError",
    "ProtocolError",
    "PSAbortedError",
    "WorkerFailedError",
    "CheckpointError",
]
