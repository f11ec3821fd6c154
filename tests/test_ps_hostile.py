"""The parameter server against hostile and failing workers (ZeroMQ transport).

Each rank of a run either is an honest worker or misbehaves in one way; the
server and every honest worker must finish, with no update lost or applied
twice: the model holds ``x`` (one entry per rank) and worker ``r`` pushes the
one-hot gradient ``e_r`` with SGD lr 1, so ``-x[r]`` counts exactly the
pushes of ``r`` that were applied. Every wait is bounded (launch deadline,
receive timeouts, polling deadlines).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
import zmq

from gradcomp import ps
from gradcomp.launch import launch
from gradcomp.ps import protocol as P
from gradcomp.ps.sharding import layout_checksum, param_specs

import ps_peers as PP

WORLD = 8  # server 0, honest workers 1 and 2, hostile ranks 3..7
PAD = 16384  # a 64 KiB parameter, so that an unread pull reply fills the queues quickly


def _params(numel, pad=PAD):
    return {"x": torch.zeros(numel), "pad": torch.zeros(pad)}


def _onehot(numel, r):
    g = torch.zeros(numel)
    g[r] = 1.0
    return {"x": g}


def _sgd1(params):
    return torch.optim.SGD(params, lr=1.0)


def _honest(rank, world_size, flag, min_pushes, deadline_s, pad=PAD):
    """Push e_rank until ``flag`` exists (and at least ``min_pushes``), within ``deadline_s``."""
    worker = ps.Worker(_params(world_size, pad), timeout=30.0)
    accepted = 0
    t_end = time.monotonic() + deadline_s
    with worker:
        worker.pull()
        while accepted < min_pushes or not os.path.exists(flag):
            assert time.monotonic() < t_end, "the hostile ranks never finished"
            accepted += worker.push(_onehot(world_size, rank)).accepted
            worker.pull()
            time.sleep(0.005)
        replayed = None
        if rank == 2:  # the same request twice: applied once, the copy rejected
            h = worker._request(P.PUSH, 0, worker.versions[0], nbytes=0)
            blob = P.pack_bundle([gc_raw(t) for t in (_onehot(world_size, rank)["x"], torch.zeros(pad))])
            h.nbytes = blob.numel()
            statuses = []
            for _ in range(2):
                worker._send(h, blob, 0, "push")
                reply, _ = worker._recv(0, h, "push")
                statuses.append(P.STATUS_NAMES[reply.status])
            replayed = statuses
            accepted += 1
        worker.pull()
    return {"accepted": accepted, "replayed": replayed}


def gc_raw(t):
    import gradcomp as gc

    return gc.NoCompression().compress(t).wire


def _hostile_rank(rank, world_size, tmp):
    dist.barrier()
    flag = os.path.join(tmp, "hostile-done")
    params = _params(world_size)
    layout = layout_checksum(param_specs(params))
    if rank == 0:
        # heartbeat_timeout far above worker_timeout: a silent raw peer (rank 4) is named for the
        # latter however late the server checks its deadlines on a loaded host
        server = ps.ParameterServer(params, mode="async", optimizer=_sgd1, worker_timeout=3.0,
                                    heartbeat_timeout=30.0)
        stats = server.serve()
        return {"stats": stats, "x": server.parameters()["x"].tolist()}
    if rank in (1, 2):
        return _honest(rank, world_size, flag, 20, 90.0)
    if rank == 6:  # alive (heartbeats flow) but silent: no request for > worker_timeout
        worker = ps.Worker(params, timeout=30.0)
        worker.pull()
        worker.push(_onehot(world_size, rank))
        time.sleep(8.0)  # well past worker_timeout, however late a loaded server checks it
        try:
            worker.push(_onehot(world_size, rank))
        except ps.PeerError as e:
            out = str(e)
        else:
            out = "pushed after its eviction"
        worker.done()
        open(flag, "w").close()  # the last hostile rank to finish
        return out
    addresses, credential = PP.server_addresses()
    address = addresses[0]
    peer = PP.RawPeer(address, rank, layout, credential=credential, rcvhwm=1 if rank == 5 else 1000,
                      rcvbuf=65536 if rank == 5 else -1)
    try:
        peer.hello()
        if rank == 3:  # a push larger than its header announces
            h = peer.header(P.PUSH, nbytes=10)
            peer.send(h.pack(), b"\0" * 1000)
            reply = peer.recv()
            return (P.KIND_NAMES[reply[0].kind], reply[1].decode())
        if rank == 4:  # a header, then silence (the message is never completed)
            peer.send(peer.header(P.PUSH, nbytes=1 << 20).pack(), more=True)
            time.sleep(6.0)
            return "silent"
        if rank == 5:  # pulls and never reads a reply
            sent = 0
            for _ in range(400):
                try:
                    peer.sock.send(peer.header(P.PULL, status=P.WANT_FULL).pack(), zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    break
            time.sleep(4.0)
            return sent
        if rank == 7:  # garbage frames, then garbage from a connection without the credential
            peer.send(b"\1\2\3", b"x", b"y", b"z")
            peer.send(os.urandom(P.HEADER_NBYTES))
            intruder = PP.RawPeer(address, rank, layout, credential=None, ident=b"w1")
            intruder.send(os.urandom(100))
            refused = intruder.handshake()
            intruder.close()
            reply = peer.recv()
            return P.KIND_NAMES[reply[0].kind], refused
    finally:
        peer.close()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_hostile_workers_cannot_stop_the_server_or_honest_workers(tmp_path):
    out = launch(_hostile_rank, WORLD, args=(str(tmp_path),), timeout=120, env={"GRADCOMP_WORKER_THREADS": "1"})
    server, x = out[0]["stats"], out[0]["x"]
    assert server["done_workers"] == [1, 2]
    dead = server["dead_workers"]
    assert sorted(dead) == [3, 4, 5, 6, 7]
    assert "protocol error" in dead[3] and "announces 10 data bytes, the message carries 1000" in dead[3]
    assert out[3] == ("EVICTED", dead[3])
    assert "silent for more than worker_timeout=3 s" in dead[4]  # its heartbeat_timeout is longer
    assert "not reading its replies" in dead[5] and out[5] > 10
    assert "silent for more than worker_timeout=3 s" in dead[6]
    assert "declared dead" in out[6] and "worker_timeout" in out[6]
    assert "protocol error" in dead[7] and out[7][0] == "EVICTED"
    assert out[7][1] in ("HANDSHAKE_FAILED_PROTOCOL", "HANDSHAKE_FAILED_NO_DETAIL")  # the intruder's view
    reasons = server["rejected_reasons"]
    assert reasons["protocol"] == 3 and reasons["duplicate"] == 1 and "unknown_peer" not in reasons
    # the intruder (no credential, routing id "w1") never got past the handshake: refused there,
    # counted, no byte of it reached the protocol, and worker 1 went on
    assert server["refused_connections"] >= 1
    refused = server["refused_reasons"]  # the mechanism mismatch, or the intruder hung up first
    assert refused.get("no credential or another mechanism", 0) + refused.get("handshake not completed", 0) >= 1
    assert out[2]["replayed"] == ["accepted", "rejected"]
    # no update lost or applied twice: -x[r] counts the applied pushes of rank r
    for r in (1, 2):
        assert -x[r] == out[r]["accepted"] == server["workers"][r]["accepted"]
    assert x[6] == -1.0 and server["workers"][6]["accepted"] == 1
    assert x[0] == x[3] == x[4] == x[5] == x[7] == 0.0
    assert server["version"] == server["accepted"] == sum(-v for v in x)


def _kill_rank(rank, world_size, tmp, pushes_after):
    dist.barrier()
    params = _params(world_size, pad=1 << 20)  # 4 MiB pushes: the kill lands inside one
    if rank == 0:
        server = ps.ParameterServer(params, mode="async", optimizer=_sgd1, worker_timeout=30.0,
                                    heartbeat_timeout=3.0)
        stats = server.serve()
        return {"stats": stats, "x": server.parameters()["x"].tolist()}
    pid_file, log = os.path.join(tmp, "victim.pid"), os.path.join(tmp, "victim.log")
    if rank == 3:  # SIGKILLed by a timer while a push is on its way
        worker = ps.Worker(params, timeout=30.0)
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        worker.pull()
        with open(log, "w") as f:
            for i in range(1000):
                if i == 3:
                    threading.Timer(0.003, os.kill, (os.getpid(), signal.SIGKILL)).start()
                if worker.push(_onehot(world_size, rank)).accepted:
                    f.write("1\n")
                    f.flush()
        return "not killed"
    if rank == 2:
        return _honest(rank, world_size, pid_file, 30, 60.0, pad=1 << 20)
    # rank 1: an honest worker that also restarts the victim as a new process
    worker = ps.Worker(params, timeout=30.0)
    accepted, proc, t_end = 0, None, time.monotonic() + 90.0
    result = os.path.join(tmp, "restarted.json")
    with worker:
        worker.pull()
        while proc is None or proc.poll() is None:
            assert time.monotonic() < t_end, "the restarted worker did not finish"
            if proc is None and os.path.exists(pid_file) and os.path.getsize(pid_file) and \
                    PP.process_gone(int(open(pid_file).read())):
                tests = os.path.dirname(os.path.abspath(PP.__file__))
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                    [tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]),
                    GRADCOMP_PS_CREDENTIAL=worker.credential)  # the job's credential, learned over the group
                code = (f"import ps_peers; ps_peers.restarted_worker_main({worker.server_addresses[0]!r}, "
                        f"3, {world_size}, {1 << 20}, {pushes_after}, {result!r})")
                proc = subprocess.Popen([sys.executable, "-c", code], env=env)
            accepted += worker.push(_onehot(world_size, rank)).accepted
            worker.pull()
            time.sleep(0.01)
        worker.pull()
    with open(log) as f:
        confirmed = len(f.read().split())
    with open(result) as f:
        restarted = json.load(f)
    return {"accepted": accepted, "confirmed": confirmed, "restarted": restarted, "rc": proc.returncode}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_worker_killed_mid_push_then_restarted(tmp_path):
    out = launch(_kill_rank, 4, args=(str(tmp_path), 5), timeout=120, expected_failures=[3])
    assert out[3] is None  # SIGKILLed
    server, x = out[0]["stats"], out[0]["x"]
    r1 = out[1]
    assert r1["rc"] == 0 and r1["restarted"]["accepted"] == 5
    confirmed, before = r1["confirmed"], r1["restarted"]["accepted_before"]
    assert confirmed >= 3  # the timer starts after the third accepted push
    # the push in flight at the kill arrived whole and was applied once, or not at all
    assert before in (confirmed, confirmed + 1)
    assert -x[3] == before + 5 == server["workers"][3]["accepted"]
    assert server["workers"][3]["sessions"] == 2 and server["workers"][3]["status"] == "done"
    for r in (1, 2):
        assert -x[r] == out[r]["accepted"] == server["workers"][r]["accepted"]
    assert server["done_workers"] == [1, 2, 3] and server["dead_workers"] == {}
    assert server["version"] == server["accepted"] == sum(-v for v in x)
