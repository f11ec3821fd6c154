"""Local launcher: run a function on N processes joined in a torch.distributed group.

This is the single-host counterpart of ``torchrun`` for tests, benchmarks and
``gradcomp train``. Rendezvous is torch.distributed's file store (no port to
race for); each rank runs ``fn(rank, world_size, *args)`` and its return value
comes back to the caller. Every wait has a deadline: a rank that raises stops
the whole run with that rank's traceback (:class:`WorkerError`), a rank that
hangs past ``timeout`` seconds gets every process killed (:class:`TimeoutError`),
and no process is left behind.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Collection, Sequence

__all__ = ["launch", "WorkerError", "init_from_env", "start_method", "DEFAULT_START_METHOD"]


class WorkerError(RuntimeError):
    """A rank failed; ``rank`` and the worker's ``traceback`` text are attached."""

    def __init__(self, rank: int, tb: str):
        super().__init__(f"rank {rank} failed:\n{tb}")
        self.rank = rank
        self.traceback = tb


def _enter_netns(name: str) -> None:
    """Move this (still single-threaded) process into the network namespace
    ``/run/netns/<name>``: every socket it opens from now on lives there."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join("/run/netns", name), os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


_CLONE_NEWNET = 0x40000000


def _worker(fn, rank, world_size, args, init_file, backend, timeout, env, results, netns=None):
    if netns is not None:
        try:
            _enter_netns(netns)
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
            return
    # one host unless the caller's environment says otherwise (the emulated
    # cluster sets torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK per host)
    os.environ.update({"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(env.get("GRADCOMP_WORKER_THREADS", "1")))
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        # every rank joins the full mesh before any may exit (a rank leaving early
        # would break a slower rank's connection setup)
        dist.barrier()
        out = fn(rank, world_size, *args)
        # pickled here: tensors sent through the queue as shared-memory handles
        # would die with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


#: multiprocessing start method of :func:`launch` when neither ``start_method=``
#: nor ``$GRADCOMP_START_METHOD`` names one
DEFAULT_START_METHOD = "forkserver"


def start_method(given: str | None = None) -> str:
    """The multiprocessing start method of :func:`launch`: ``given``, else
    ``$GRADCOMP_START_METHOD`` (read at each call: one launch per run), else
    :data:`DEFAULT_START_METHOD`."""
    return given or os.environ.get("GRADCOMP_START_METHOD", DEFAULT_START_METHOD)


def _context(given: str | None):
    method = start_method(given)
    ctx = mp.get_context(method)
    if method == "forkserver":
        # torch._dynamo: DistributedDataParallel imports it (seconds); load it once, not per run
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "gradcomp"])
    return ctx


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    expected_failures: Collection[int] = (),
    start_method: str | None = None,
    rank_env: Sequence[dict[str, str]] | None = None,
    netns: Sequence[str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of processes (>= 1).
        args: extra picklable arguments.
        timeout: seconds for the whole run and for every collective inside it.
        backend: torch.distributed backend (``"gloo"`` on CPU).
        env: extra environment variables for the workers
            (``GRADCOMP_WORKER_THREADS`` sets torch threads per worker, default 1).
        expected_failures: ranks allowed to die (failure tests); their result is None.
        start_method: multiprocessing start method (default: :func:`start_method`,
            ``$GRADCOMP_START_METHOD`` or ``forkserver``).
        rank_env: per-rank environment variables on top of ``env`` (one dict per rank).
            ``RANK`` and ``WORLD_SIZE`` are always set by the launcher;
            ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` default to the rank and
            the world size (one host) unless ``env`` or ``rank_env`` set them.
        netns: per-rank network namespace names (``ip netns`` names, one per
            rank): each rank enters its namespace before it opens a socket
            (used by :class:`gradcomp.lab.cluster.LocalCluster`; needs root).

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        ValueError: world_size < 1, timeout not a finite number in (0, 1e9], or
            ``rank_env`` / ``netns`` not of length ``world_size``.
        WorkerError: a rank raised or died (the first such rank is reported).
        TimeoutError: the run did not finish within ``timeout`` seconds.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    from gradcomp._validate import timeout as _timeout

    timeout = _timeout("timeout", timeout)
    for name, seq in (("rank_env", rank_env), ("netns", netns)):
        if seq is not None and len(seq) != world_size:
            raise ValueError(f"{name} must have one entry per rank ({world_size}), got {len(seq)}")
    ctx = _context(start_method)
    results = ctx.Queue()
    env = dict(env or {})
    tmpdir = tempfile.mkdtemp(prefix="gradcomp-rdzv-")
    init_file = os.path.join(tmpdir, "store")
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(fn, r, world_size, args, init_file, backend, timeout,
                          {**env, **(rank_env[r] if rank_env is not None else {})}, results,
                          netns[r] if netns is not None else None))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while len(out) < world_size:
            try:
                rank, ok, val = results.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and not p.is_alive() and p.exitcode is not None:
                        # give a result already in flight a moment to arrive
                        try:
                            rank, ok, val = results.get(timeout=1.0)
                            break
                        except queue.Empty:
                            if r in expected_failures:
                                out[r] = None
                                continue
                            raise WorkerError(r, f"process exited with code {p.exitcode} "
                                                 "without reporting a result") from None
                else:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"launch: ranks {sorted(set(range(world_size)) - set(out))} "
                                           f"did not finish within {timeout} s")
                    continue
            if not ok and rank not in expected_failures:
                raise WorkerError(rank, val)
            out[rank] = pickle.loads(val) if ok else None
        finished = True
        return [out[r] for r in range(world_size)]
    finally:
        # after success the ranks are only tearing down; after a failure the
        # remaining ranks are killed at once
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if finished else 0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        # the directory with whatever the store left in it
        shutil.rmtree(tmpdir, ignore_errors=True)


def init_from_env(backend: str = "gloo", timeout: float = 120.0) -> tuple[int, int]:
    """Join the process group described by ``torchrun``'s environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) unless already
    joined; returns ``(rank, world_size)``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()
