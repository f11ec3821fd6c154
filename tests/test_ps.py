"""Parameter server (gradcomp.ps): protocol units, then multi-process runs on gloo.

Every multi-process test runs its ranks with gradcomp.launch (forkserver, file
store) under a deadline; rank functions are module-level so they pickle.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import gradcomp as gc
from gradcomp import ps
from gradcomp.launch import launch
from gradcomp.ps import protocol as P
from gradcomp.ps.sharding import layout_checksum, param_specs

import ps_peers as PP

LAUNCH_TIMEOUT = 100.0


def _sgd(lr, momentum=0.0):
    return functools.partial(torch.optim.SGD, lr=lr, momentum=momentum)


def _joined(group=None):
    """Every rank has finished joining the group before any can leave it."""
    dist.barrier(group)


def _np(obj):
    """Tensors -> numpy arrays, recursively: launch's result queue would pass
    tensors as shared-memory handles that die with the rank's process."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: _np(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_np(v) for v in obj)
    return obj


def _t(a):
    return torch.from_numpy(a)


# ---------------------------------------------------------------- units (one process)
def test_shard_parameters_balances_bytes_largest_first():
    specs = param_specs({"a": torch.zeros(10), "b": torch.zeros(40), "c": torch.zeros(30),
                         "d": torch.zeros(25), "e": torch.zeros(5)})
    shards = ps.shard_parameters(specs, 2)
    names = [[s.name for s in sh] for sh in shards]
    # largest first: b -> 0, c -> 1, d -> 1 (30 < 40), a -> 0 (40 < 55), e -> 0 (50 < 55)
    assert names == [["a", "b", "e"], ["c", "d"]]
    loads = [sum(s.numel for s in sh) for sh in shards]
    assert loads == [55, 55]
    assert ps.shard_parameters(specs, 2) == shards  # deterministic
    assert [len(sh) for sh in ps.shard_parameters(specs, 5)] == [1] * 5
    with pytest.raises(ValueError, match="num_servers"):
        ps.shard_parameters(specs, 6)
    with pytest.raises(ValueError, match="num_servers"):
        ps.shard_parameters(specs, 0)
    with pytest.raises(TypeError, match="num_servers"):
        ps.shard_parameters(specs, 1.5)


def test_bundle_roundtrip_and_malformed_bundles():
    ws = [gc.Int8Quantizer().compress(torch.randn(300)).wire,
          gc.TopK(0.1, values=gc.Int8Quantizer()).compress(torch.randn(7, 9)).wire,
          gc.NoCompression().compress(torch.randn(3)).wire]
    blob = P.pack_bundle(ws)
    assert blob.dtype == torch.uint8 and blob.numel() == 8 * 4 + sum(w.numel() for w in ws)
    back = P.unpack_bundle(blob, 3)
    assert all(torch.equal(a, b) for a, b in zip(ws, back))
    with pytest.raises(gc.PayloadError, match="expected 2"):
        P.unpack_bundle(blob, 2)
    with pytest.raises(gc.PayloadError, match="do not add up"):
        P.unpack_bundle(blob[:-1], 3)
    with pytest.raises(gc.PayloadError, match="shorter"):
        P.unpack_bundle(blob[:5], 3)
    assert P.raw_bundle_nbytes([(300,), (7, 9)]) == 8 * 3 + (40 + 8 + 1200) + (40 + 16 + 252)


def test_header_validation():
    h = P.Header(P.PUSH, 3, version=7, nbytes=100, layout=11, aux=2, seq=5, session=9)
    frame = h.pack()
    assert len(frame) == P.HEADER_NBYTES == 80
    assert P.Header.unpack(frame, P.REQUESTS, 100) == h
    bad = bytearray(frame)
    bad[0] ^= 1
    with pytest.raises(ps.ProtocolError, match="magic"):
        P.Header.unpack(bytes(bad), P.REQUESTS, 100)
    with pytest.raises(ps.ProtocolError, match="kind"):
        P.Header.unpack(P.Header(P.PULL_REPLY, 0).pack(), P.REQUESTS, None)
    with pytest.raises(ps.ProtocolError, match="announces 100 data bytes, the message carries 101"):
        P.Header.unpack(frame, P.REQUESTS, 101)  # a push larger than its header says
    with pytest.raises(ps.ProtocolError, match="carries 0"):
        P.Header.unpack(frame, P.REQUESTS, None)
    with pytest.raises(ps.ProtocolError, match="header frame of 79 bytes"):
        P.Header.unpack(frame[:-1], P.REQUESTS, 100)
    # ZMTP/3.1 framing (RFC 37): flags + 1-byte length up to 255 bytes, flags + 8-byte length above
    assert P.message_nbytes() == 80 + 2
    assert P.message_nbytes(255) == 82 + 255 + 2 and P.message_nbytes(256) == 82 + 256 + 9


def test_addresses_normalized_and_default_host(monkeypatch):
    from gradcomp.ps import transport as T

    assert T.normalize_address("10.0.0.1") == "tcp://10.0.0.1:0"
    assert T.normalize_address("node3:5555") == "tcp://node3:5555"
    assert T.normalize_address("tcp://127.0.0.1:7") == "tcp://127.0.0.1:7"
    assert T.normalize_address("::1") == "tcp://[::1]:0" and T.normalize_address("[::1]:9") == "tcp://[::1]:9"
    for bad in ("udp://x:1", "host:port", "h:70000", ""):
        with pytest.raises(ValueError, match="address"):
            T.normalize_address(bad)
    with pytest.raises(TypeError, match="address"):
        T.normalize_address(5555)
    monkeypatch.delenv("GRADCOMP_PS_HOST", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert T.default_host() == "127.0.0.1"  # the interface that routes to the master
    monkeypatch.setenv("GRADCOMP_PS_HOST", "192.0.2.7")
    assert T.default_host() == "192.0.2.7"


def test_config_and_constructor_errors_name_the_argument(monkeypatch):
    with pytest.raises(ValueError, match="mode must be one of"):
        ps.PSConfig(mode="semi")
    with pytest.raises(ValueError, match="on_worker_failure must be one of"):
        ps.PSConfig(on_worker_failure="retry")
    with pytest.raises(ValueError, match="worker_timeout"):
        ps.PSConfig(worker_timeout=0)
    with pytest.raises(TypeError, match="compressor"):
        ps.PSConfig(compressor="int8")
    with pytest.raises(TypeError, match="steps"):
        ps.PSConfig(steps=2.5)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="not initialised"):
            ps.ParameterServer({"x": torch.zeros(3)})
    assert ps.role(0, 1) == "server" and ps.role(1, 1) == "worker"
    c = ps.PSConfig(compressor=gc.ErrorFeedback(gc.TopK(0.01)), compress_pull=True)
    assert isinstance(c.server_pull_compressor(), gc.TopK)
    with pytest.raises(ValueError, match="heartbeat_interval"):
        ps.PSConfig(heartbeat_interval=10.0, heartbeat_timeout=5.0)
    with pytest.raises(ValueError, match="address"):
        ps.PSConfig(address="udp://10.0.0.1:5555")
    with pytest.raises(TypeError, match="encrypt must be a bool"):
        ps.PSConfig(encrypt="yes")
    with pytest.raises(ValueError, match="credential is for PLAIN, which contradicts encrypt=True"):
        ps.PSConfig(encrypt=True, credential=ps.new_credential())
    with pytest.raises(ValueError, match="credential must be 'gcps-plain-<64 hex digits>'"):
        ps.PSConfig(credential="hunter2")
    secret = ps.new_credential(encrypt=True)
    assert secret not in repr(ps.PSConfig(encrypt=True, credential=secret))
    x = {"x": torch.zeros(4)}
    with pytest.raises(ValueError, match="num_servers=2 endpoints, got 1"):
        ps.Worker(x, num_servers=2, rank=3, server_addresses=["tcp://127.0.0.1:1"])
    with pytest.raises(TypeError, match="server_addresses"):
        ps.Worker(x, rank=3, server_addresses="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="server rank"):
        ps.Worker(x, rank=0, server_addresses=["tcp://127.0.0.1:1"])
    with pytest.raises(ValueError, match="rank is given with server_addresses only"):
        ps.Worker(x, rank=3)
    with pytest.raises(ValueError, match="credential is given with server_addresses only"):
        ps.Worker(x, credential=ps.new_credential())
    monkeypatch.delenv("GRADCOMP_PS_CREDENTIAL", raising=False)
    with pytest.raises(ValueError, match="needs the job's credential: pass credential="):
        ps.Worker(x, rank=3, server_addresses=["127.0.0.1:1"])
    monkeypatch.setenv("GRADCOMP_PS_CREDENTIAL", "not-a-credential")
    with pytest.raises(ValueError, match=r"\$GRADCOMP_PS_CREDENTIAL must be 'gcps-plain-"):
        ps.Worker(x, rank=3, server_addresses=["127.0.0.1:1"])
    with pytest.raises(ValueError, match="incarnation must be"):
        ps.Worker(x, rank=3, server_addresses=["127.0.0.1:1"], incarnation=-1)
    with pytest.raises(ValueError, match="heartbeat_interval"):
        ps.Worker(x, rank=3, server_addresses=["127.0.0.1:1"], heartbeat_interval=0)
    # an error feedback given with error_feedback=False was used without a word
    for ef in (gc.ErrorFeedback(gc.Int8Quantizer()), gc.DGC(gc.TopK(ratio=0.1))):
        with pytest.raises(ValueError, match="error_feedback=False contradicts compressor"):
            ps.Worker(x, rank=3, server_addresses=["127.0.0.1:1"], compressor=ef, error_feedback=False)
        with pytest.raises(ValueError, match="error_feedback=False contradicts compressor"):
            ps.PSConfig(compressor=ef, error_feedback=False)


# ---------------------------------------------------------------- sync == data-parallel SGD
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(worker, step):
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _mse(model, step, worker):
    x, y = _batch(worker, step)
    return torch.nn.functional.mse_loss(model(x), y)


def _sync_rank(rank, world_size, config):
    _joined()
    if rank == 0:
        for bad, match in [({"mode": "semi"}, "mode must be one of"),
                           ({"max_staleness": -1}, "max_staleness"),
                           ({"on_worker_failure": "x"}, "on_worker_failure"),
                           ({"num_servers": world_size}, "num_servers")]:
            try:
                ps.ParameterServer(_mlp(), **bad)
            except ValueError as e:
                assert match in str(e), (bad, e)
            else:
                raise AssertionError(f"{bad} accepted")
    return _np(ps.run(rank, world_size, _mlp, _mse, config))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sync_no_compression_equals_data_parallel_sgd():
    steps, workers, servers = 5, 2, 2
    config = ps.PSConfig(mode="sync", steps=steps, num_servers=servers, optimizer=_sgd(0.1, 0.9))
    out = launch(_sync_rank, servers + workers, args=(config,), timeout=LAUNCH_TIMEOUT)

    # single-process reference: average the workers' gradients, one SGD step
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        grads = []
        for w in range(workers):
            ref.zero_grad()
            _mse(ref, step, w).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, *gs in zip(ref.parameters(), *grads):
            p.grad = sum(gs) / workers
        opt.step()

    server_params = {n: _t(a) for s in range(servers) for n, a in out[s]["params"].items()}
    assert sorted(server_params) == sorted(n for n, _ in ref.named_parameters())
    assert all(out[s]["params"] for s in range(servers))  # both servers hold a shard
    for name, p in ref.named_parameters():
        torch.testing.assert_close(server_params[name], p.detach(), rtol=1e-5, atol=1e-6)
    for w in range(servers, servers + workers):  # every replica is the servers' parameters
        for name, a in out[w]["params"].items():
            assert torch.equal(_t(a), server_params[name])
        assert out[w]["stats"]["accepted"] == steps
    for s in range(servers):
        st = out[s]["stats"]
        assert st["version"] == steps and st["accepted"] == steps * workers
        assert st["dropped"] == st["rejected"] == 0 and st["done_workers"] == [2, 3]
        assert st["staleness_histogram"] == {0: steps * workers}


# ---------------------------------------------------------------- async convex problem
DIM, ROWS = 32, 128


def _lsq(worker):
    g = torch.Generator().manual_seed(7)
    x_star = torch.randn(DIM, generator=g)
    a = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(100 + worker))
    return a, x_star


def _lsq_model():
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.zeros(DIM // 2))
    m.b = torch.nn.Parameter(torch.zeros(DIM // 2))
    return m


def _lsq_loss(model, step, worker):
    a, x_star = _lsq(worker)
    r = a @ torch.cat([model.a, model.b]) - a @ x_star
    return 0.5 * (r * r).mean()


def _async_convex_rank(rank, world_size, config):
    workers = dist.new_group(list(range(config.num_servers, world_size)))
    _joined()
    if rank < config.num_servers:
        return _np(ps.run(rank, world_size, _lsq_model, _lsq_loss, config))
    model = _lsq_model()
    worker = ps.Worker(model, num_servers=config.num_servers, compressor=config.compressor.clone(),
                       timeout=config.timeout)
    index = rank - config.num_servers
    for step in range(config.steps):
        worker.pull()
        model.zero_grad()
        _lsq_loss(model, step, index).backward()
        worker.push()
    dist.barrier(workers)  # no push after this: the final pull sees the final parameters
    before = {n: t.clone() for n, t in worker.replica.items()}
    worker.pull()
    after = {n: t.clone() for n, t in worker.replica.items()}
    worker.done()
    return _np({"before": before, "after": after, "stats": worker.stats()})


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["int8", "topk_ef"])
def test_async_least_squares_reaches_optimum(kind):
    if kind == "int8":
        comp, servers, steps, lr = gc.Int8Quantizer(), 1, 150, 0.2
    else:
        comp, servers, steps, lr = gc.TopK(ratio=0.25, values=gc.Int8Quantizer()), 2, 300, 0.2
    config = ps.PSConfig(mode="async", steps=steps, num_servers=servers, compressor=comp,
                         compress_pull=True, optimizer=_sgd(lr))
    out = launch(_async_convex_rank, servers + 2, args=(config,), timeout=LAUNCH_TIMEOUT)
    x = torch.cat([_t(a) for s in range(servers) for a in out[s]["params"].values()])
    _, x_star = _lsq(0)
    rel = float((x - x_star).norm() / x_star.norm())
    assert rel < 1e-3, rel  # stated tolerance: relative distance to the known optimum
    server = {n: _t(a) for s in range(servers) for n, a in out[s]["params"].items()}
    updates = sum(out[s]["stats"]["updates"] for s in range(servers)) // servers
    assert updates == 2 * steps
    for w in range(servers, servers + 2):
        before = {n: _t(a) for n, a in out[w]["before"].items()}
        after = {n: _t(a) for n, a in out[w]["after"].items()}
        for n in server:
            delta = server[n] - before[n]
            err = (server[n] - after[n]).abs()
            if kind == "int8":  # nearest rounding: |error| <= absmax(block) / 254
                assert float(err.max()) <= float(delta.abs().max()) / 254 * 1.001 + 1e-7
            else:  # top-k contraction (Stich et al. 2018): ||e||^2 <= (1 - k/n) ||delta||^2, + int8 slack
                k = math.ceil(0.25 * delta.numel())
                bound = (1 - k / delta.numel()) * float(delta.norm() ** 2)
                assert float(err.norm() ** 2) <= bound * 1.01 + 1e-10
        assert out[w]["stats"]["dropped"] == 0


# ---------------------------------------------------------------- staleness
def _slow_rank(rank, world_size, flag_path):
    _joined()
    params = {"x": torch.zeros(16)}
    if rank == 0:
        server = ps.ParameterServer(params, mode="async", max_staleness=2, staleness_lr=True,
                                    optimizer=_sgd(0.01))
        return server.serve()
    worker = ps.Worker(params, compressor=gc.Int8Quantizer())
    g = {"x": torch.ones(16)}
    results = []
    count_path = flag_path + ".pushes"  # the fast worker's pushes so far

    def pushes() -> int:
        try:
            with open(count_path) as f:
                return int(f.read() or 0)
        except FileNotFoundError:
            return 0

    with worker:
        if rank == 1:  # fast: keeps pushing until the slow worker is done
            deadline = time.monotonic() + 60
            while not os.path.exists(flag_path) and time.monotonic() < deadline:
                worker.pull()
                results.append(worker.push(g).statuses[0])
                with open(count_path + ".tmp", "w") as f:
                    f.write(str(len(results)))
                os.replace(count_path + ".tmp", count_path)
                time.sleep(0.002)
        else:  # slow: its gradients arrive many versions late (waits for 3 of the fast one's pushes)
            for _ in range(4):
                worker.pull()
                n0 = pushes()
                PP.wait_until(lambda: pushes() >= n0 + 3, 30.0, "the fast worker's pushes")
                results.append(worker.push(g).statuses[0])
            open(flag_path, "w").close()
    return results


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_slow_worker_stale_gradients_dropped(tmp_path):
    out = launch(_slow_rank, 3, args=(str(tmp_path / "slow-done"),), timeout=LAUNCH_TIMEOUT)
    stats, fast, slow = out
    assert "dropped" in slow
    assert stats["dropped"] == slow.count("dropped") + fast.count("dropped") >= 1
    assert stats["workers"][2]["dropped"] == slow.count("dropped")
    assert max(stats["staleness_histogram"]) <= 2  # max_staleness honoured
    assert min(stats["dropped_staleness_histogram"]) > 2
    assert stats["accepted"] + stats["dropped"] == stats["pushes"] == len(fast) + len(slow)
    assert stats["version"] == stats["accepted"]


# ---------------------------------------------------------------- failures
def _ps_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("gradcomp-ps")]


def _failing_rank(rank, world_size, mode, policy, victim, steps):
    _joined()
    if rank == 0:
        server = ps.ParameterServer({"x": torch.zeros(64)}, mode=mode, on_worker_failure=policy,
                                    worker_timeout=20.0, heartbeat_timeout=3.0, optimizer=_sgd(0.01),
                                    clip_grad_norm=1.0)
        try:
            return ("served", server.serve(), _ps_threads())
        except ps.WorkerFailedError as e:
            return ("raised", str(e), e.rank, server.stats())
    worker = ps.Worker({"x": torch.zeros(64)}, compressor=gc.Int8Quantizer())
    try:
        with worker:
            for step in range(steps):
                worker.pull()
                if rank == victim and step == 3:
                    os._exit(1)  # dies without a word: no DONE, no exception
                worker.push({"x": torch.full((64,), float(rank))})
            worker.pull()
    except ps.PSAbortedError as e:
        return ("aborted", e.failed_rank)
    return ("finished", worker.stats())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_async_killed_worker_others_finish():
    out = launch(_failing_rank, 4, args=("async", "continue", 2, 20), timeout=LAUNCH_TIMEOUT,
                 expected_failures=[2])
    assert out[2] is None
    kind, stats, threads_left = out[0]
    assert kind == "served" and threads_left == []  # receiving threads all ended
    assert list(stats["dead_workers"]) == [2] and "heartbeat" in stats["dead_workers"][2]
    assert stats["done_workers"] == [1, 3]
    assert out[1][0] == out[3][0] == "finished"
    assert stats["version"] == stats["accepted"] == 3 + 2 * 20
    assert stats["clipped"] == stats["accepted"]  # |g| = 8 * rank > 1: every step clipped
    assert multiprocessing.active_children() == []  # no rank process left behind


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["fail", "continue"])
def test_sync_worker_failure_policy(policy):
    steps = 10
    out = launch(_failing_rank, 4, args=("sync", policy, 3, steps), timeout=LAUNCH_TIMEOUT,
                 expected_failures=[3])
    assert out[3] is None
    if policy == "fail":
        kind, msg, failed, stats = out[0]
        assert kind == "raised" and failed == 3
        assert "worker rank 3" in msg and "on_worker_failure='fail'" in msg
        assert out[1] == out[2] == ("aborted", 3)
        assert stats["version"] == 3  # the step the victim never pushed was not applied
    else:
        kind, stats, _ = out[0]
        assert kind == "served" and list(stats["dead_workers"]) == [3]
        assert stats["version"] == steps  # steps 3.. completed with the two live workers
        assert stats["accepted"] == 3 * 3 + 2 * (steps - 3)
        assert out[1][0] == out[2][0] == "finished"
        assert out[1][1]["version"] == steps


# ---------------------------------------------------------------- checkpoint and restart
class _CrashingServer(ps.ParameterServer):
    """Dies (no cleanup, no final checkpoint) right after applying version ``crash_at``."""

    crash_at = 7

    def _apply(self, grads, staleness):
        super()._apply(grads, staleness)
        if self.version == self.crash_at:
            os._exit(3)


def _restart_rank(rank, world_size, ckpt_dir, resume, steps):
    _joined()
    cls = ps.ParameterServer if resume else _CrashingServer
    if rank == 0:
        server = cls(_mlp(), mode="sync", optimizer=_sgd(0.05, 0.9), checkpoint_dir=ckpt_dir,
                     checkpoint_every=3, resume=resume)
        resumed = server.resumed_from
        has_momentum = all("momentum_buffer" in server.optimizer.state[p] for p in server.params.values())
        stats = server.serve()
        return _np({"resumed_from": resumed, "momentum_restored": has_momentum, "stats": stats,
                    "params": server.parameters()})
    model = _mlp()
    with ps.Worker(model) as worker:
        first = {n: t.clone() for n, t in worker.pull().items()}
        first_version = worker.version
        for step in range(steps):
            model.zero_grad()
            _mse(model, step, rank).backward()
            worker.push()
            worker.pull()
    return _np({"first": first, "first_version": first_version})


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_server_restart_resumes_from_checkpoint(tmp_path):
    ckpt_dir = str(tmp_path)
    out = launch(_restart_rank, 3, args=(ckpt_dir, False, 20), timeout=LAUNCH_TIMEOUT,
                 expected_failures=[0, 1, 2])
    assert out[0] is None  # the server died at version 7; the last checkpoint is version 6
    saved = torch.load(os.path.join(ckpt_dir, "ps-server-0.pt"), weights_only=True)
    assert saved["version"] == 6
    assert not [f for f in os.listdir(ckpt_dir) if ".tmp" in f]  # atomic: no partial files left

    out = launch(_restart_rank, 3, args=(ckpt_dir, True, 4), timeout=LAUNCH_TIMEOUT)
    server = out[0]
    assert server["resumed_from"] == 6 and server["momentum_restored"]
    assert server["stats"]["version"] == 10 and server["stats"]["updates"] == 4
    for w in (1, 2):
        assert out[w]["first_version"] == 6
        for n, a in out[w]["first"].items():
            assert torch.equal(_t(a), saved["params"][n])  # workers resume from the checkpoint
    final = torch.load(os.path.join(ckpt_dir, "ps-server-0.pt"), weights_only=True)
    assert final["version"] == 10  # checkpointed at shutdown
    for n, a in server["params"].items():
        assert torch.equal(final["params"][n], _t(a))


# ---------------------------------------------------------------- malformed input
def _garbage_rank(rank, world_size):
    _joined()
    params = {"x": torch.zeros(8)}
    layout = layout_checksum(param_specs(params))
    if rank == 0:
        server = ps.ParameterServer(params, mode="async", staleness_lr=True, optimizer=_sgd(1.0),
                                    worker_timeout=20.0)
        return server.serve()
    if rank == 2:  # breaks the protocol itself: a header with a bad magic number
        addresses, credential = PP.server_addresses()
        peer = PP.RawPeer(addresses[0], rank, layout, credential=credential)
        peer.hello()
        bad = bytearray(peer.header(P.PUSH).pack())
        bad[0] = 42
        peer.send(bad)
        reply = peer.recv()
        peer.close()
        return (P.KIND_NAMES[reply[0].kind], reply[1].decode())
    worker = ps.Worker(params, timeout=20.0)
    worker.pull()
    g = torch.arange(8, dtype=torch.float32)
    statuses = [worker.push({"x": g}).statuses[0]]      # staleness 0: x = -g
    statuses.append(worker.push({"x": g}).statuses[0])  # stamped 0, server at 1: lr / 2
    statuses.append(PP.raw_push(worker, torch.randint(0, 256, (100,), dtype=torch.uint8), 2))  # garbage
    statuses.append(PP.raw_push(worker, P.pack_bundle([gc.Int8Quantizer().compress(torch.ones(4)).wire]), 2))
    wire = gc.NoCompression().compress(torch.ones(8)).wire.clone()
    wire[5] = 99  # unknown codec id -> PayloadError (header CRC)
    statuses.append(PP.raw_push(worker, P.pack_bundle([wire]), 2))
    statuses.append(worker.push({"x": torch.full((8,), float("nan"))}).statuses[0])  # non-finite
    x_mid = worker.pull()["x"].clone()
    statuses.append(worker.push({"x": g}).statuses[0])  # still serving
    worker.pull()
    worker.done()
    return _np((statuses, x_mid, worker.replica["x"]))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_garbage_payload_rejected_and_counted():
    out = launch(_garbage_rank, 3, timeout=LAUNCH_TIMEOUT)
    stats, (statuses, x_mid, x_end), evicted = out
    assert evicted[0] == "EVICTED" and "bad header magic 0x5350432a" in evicted[1]
    x_mid, x_end = _t(x_mid), _t(x_end)
    assert statuses == ["accepted", "accepted", "rejected", "rejected", "rejected", "rejected", "accepted"]
    g = torch.arange(8, dtype=torch.float32)
    torch.testing.assert_close(x_mid, -1.5 * g)  # staleness-scaled lr: 1 + 1 / (1 + 1)
    torch.testing.assert_close(x_end, -2.5 * g)
    assert stats["rejected_reasons"] == {"payload": 2, "shape": 1, "nonfinite": 1, "protocol": 1}
    assert stats["rejected"] == 5 and stats["workers"][1]["rejected"] == 4
    assert list(stats["dead_workers"]) == [2] and "protocol error" in stats["dead_workers"][2]
    assert stats["version"] == 3 and stats["staleness_histogram"] == {0: 2, 1: 1}


# ---------------------------------------------------------------- traffic
TRAFFIC_SHAPES = {"w1": (300, 256), "b1": (300,), "w2": (100, 300), "b2": (100,)}  # 107,200 parameters


def _traffic_rank(rank, world_size, compressor, compress_pull, steps):
    _joined()
    params = {n: torch.zeros(s) for n, s in TRAFFIC_SHAPES.items()}
    if rank == 0:
        server = ps.ParameterServer(params, mode="sync", compress_pull=compress_pull,
                                    pull_compressor=None if compressor is None else compressor.clone(),
                                    optimizer=_sgd(0.01, 0.9))
        return server.serve()
    worker = ps.Worker(params, compressor=None if compressor is None else compressor.clone())
    gen = torch.Generator().manual_seed(rank)
    with worker:
        worker.pull()  # the first pull is the full float32 model, outside the per-step count
        start = worker.meter.as_dict()
        for _ in range(steps):
            worker.push({n: torch.randn(s, generator=gen) for n, s in TRAFFIC_SHAPES.items()})
            worker.pull()
        end = worker.meter.as_dict()
    keys = ("bytes_sent", "bytes_received", "raw_bytes_sent", "raw_bytes_received")
    return {"steady": {k: end[k] - start[k] for k in keys}, "total": worker.meter.as_dict()}  # with DONE


def _ratio(out, steps):
    steady = [w["steady"] for w in out[1:]]
    moved = sum(d["bytes_sent"] + d["bytes_received"] for d in steady)
    raw = sum(d["raw_bytes_sent"] + d["raw_bytes_received"] for d in steady)
    return raw / moved, moved / steps / (len(out) - 1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_traffic_ratios_from_the_meter():
    steps = 3
    assert sum(math.prod(s) for s in TRAFFIC_SHAPES.values()) >= 100_000
    cases = {
        "none": (None, False),
        "int8": (gc.Int8Quantizer(), True),
        "topk": (gc.TopK(ratio=0.01, values=gc.Int8Quantizer()), True),
    }
    ratios = {}
    for name, (comp, pull) in cases.items():
        out = launch(_traffic_rank, 3, args=(comp, pull, steps), timeout=LAUNCH_TIMEOUT)
        ratios[name], per_step = _ratio(out, steps)
        server, workers = out[0], out[1:]
        # every byte is counted once by its sender and once by its receiver
        assert server["traffic"]["bytes_received"] == sum(w["total"]["bytes_sent"] for w in workers)
        assert server["traffic"]["bytes_sent"] == sum(w["total"]["bytes_received"] for w in workers)
    assert ratios["none"] == pytest.approx(1.0)
    assert ratios["int8"] >= 3.5, ratios
    assert ratios["topk"] >= 15, ratios


def _overflow_push_rank(rank, world_size):
    """A worker pushes an fp16 payload whose header (valid CRC) declares the scale
    exponent 1024: it used to pass decode and raise OverflowError in the server's
    decompress, which stopped serve() for every worker."""
    import struct
    import zlib

    _joined()
    params = {"x": torch.zeros(8)}
    if rank == 0:
        server = ps.ParameterServer(params, mode="async", optimizer=_sgd(1.0), worker_timeout=20.0)
        stats = server.serve()
        return _np((stats["rejected_reasons"], server.parameters()["x"]))
    worker = ps.Worker(params, timeout=20.0)
    worker.pull()
    body = struct.pack("<4sBBBBB3sIQQq", b"GCMP", 1, 2, 1, 1, 0, b"\0\0\0", 1024, 8, 0, 8)
    wire = body + struct.pack("<I", zlib.crc32(body)) + b"\0\0\0\0" + struct.pack("<8e", *[1.0] * 8)
    status = PP.raw_push(worker, P.pack_bundle([torch.frombuffer(bytearray(wire), dtype=torch.uint8)]), 0)
    after = worker.push({"x": torch.ones(8)}).statuses[0]  # the server still serves
    worker.done()
    return status, after


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_overflowing_fp16_push_is_rejected_not_fatal():
    (reasons, x), (status, after) = launch(_overflow_push_rank, 2, timeout=LAUNCH_TIMEOUT)
    assert (status, after) == ("rejected", "accepted")
    assert reasons == {"payload": 1}
    torch.testing.assert_close(_t(x), -torch.ones(8))


# ---------------------------------------------------------------- checkpoints that cannot be resumed
def _good_checkpoint(path):
    from gradcomp.ps import checkpoint as ckpt

    params = {"x": torch.arange(4.0)}
    opt = torch.optim.SGD([torch.nn.Parameter(params["x"].clone())], lr=0.1, momentum=0.9)
    ckpt.save_atomic({"format": ckpt.FORMAT, "server_index": 0, "num_servers": 1, "mode": "async",
                      "layout": [["x", [4]]], "version": 5, "params": params,
                      "optimizer": opt.state_dict()}, path)


def test_bad_checkpoints_raise_one_checkpoint_error(tmp_path):
    import pickle

    from gradcomp.ps import checkpoint as ckpt

    good = str(tmp_path / "good.pt")
    _good_checkpoint(good)
    assert ckpt.load(good, [["x", [4]]], 1)["version"] == 5
    blob = open(good, "rb").read()
    cases = {
        "truncated": (blob[: len(blob) // 2], "unreadable"),
        "random": (os.urandom(4096), "unreadable"),
        "foreign pickle": (pickle.dumps({"format": "gradcomp.ps/1", "x": print}, protocol=2), "unreadable"),
        "empty": (b"", "unreadable"),
    }
    for name, (data, match) in cases.items():
        path = str(tmp_path / f"{name}.pt")
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(ps.CheckpointError, match=match) as e:
            ckpt.load(path)
        assert e.value.path == path and path in str(e.value), name
    foreign = str(tmp_path / "foreign.pt")
    torch.save({"model": torch.zeros(3)}, foreign)
    with pytest.raises(ps.CheckpointError, match="not a gradcomp parameter-server checkpoint"):
        ckpt.load(foreign)
    with pytest.raises(ps.CheckpointError, match="another parameter placement"):
        ckpt.load(good, [["x", [5]]], 1)
    state = torch.load(good, weights_only=True)
    state["params"]["x"] = torch.zeros(3)
    torch.save(state, foreign)
    with pytest.raises(ps.CheckpointError, match="parameter 'x'"):
        ckpt.load(foreign)
    assert issubclass(ps.CheckpointError, ValueError)


def _resume_bad_rank(rank, world_size, ckpt_dir):
    _joined()
    if rank == 1:
        with ps.Worker({"x": torch.zeros(4)}, timeout=30.0) as worker:
            worker.pull()
            first = worker.replica["x"].clone()
            worker.push({"x": torch.ones(4)})
        return _np(first)
    path = os.path.join(ckpt_dir, "ps-server-0.pt")
    _good_checkpoint(path)
    blob = open(path, "rb").read()
    errors = []
    for data in (blob[:-100], os.urandom(len(blob))):  # truncated, random
        with open(path, "wb") as f:
            f.write(data)
        try:
            ps.ParameterServer({"x": torch.zeros(4)}, mode="async", checkpoint_dir=ckpt_dir, resume=True)
        except ps.CheckpointError as e:
            errors.append(e.reason.split(" ")[0])
    _good_checkpoint(path)
    state = torch.load(path, weights_only=True)
    state["optimizer"]["param_groups"].append(dict(state["optimizer"]["param_groups"][0]))
    torch.save(state, path)  # an optimizer state of two parameter groups: rejected before any change
    try:
        ps.ParameterServer({"x": torch.zeros(4)}, mode="async", checkpoint_dir=ckpt_dir, resume=True)
    except ps.CheckpointError as e:
        errors.append(e.reason.split(" ")[0])
    _good_checkpoint(path)
    server = ps.ParameterServer({"x": torch.zeros(4)}, mode="async", checkpoint_dir=ckpt_dir, resume=True,
                                optimizer=_sgd(0.1, 0.9))
    return errors, server.resumed_from, server.serve()["version"]


@pytest.mark.timeout(120)
def test_resume_from_a_bad_checkpoint_raises_before_serving(tmp_path):
    (errors, resumed, version), first = launch(_resume_bad_rank, 2, args=(str(tmp_path),),
                                               timeout=LAUNCH_TIMEOUT)
    assert errors == ["unreadable", "unreadable", "its"], errors
    assert resumed == 5 and version == 6
    assert torch.equal(_t(first), torch.arange(4.0))  # the good checkpoint's parameters
