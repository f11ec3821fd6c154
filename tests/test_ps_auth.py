"""Who may connect to a parameter server, and who holds a worker rank (ZeroMQ transport).

The model holds ``x`` (one entry per rank) and worker ``r`` pushes the
one-hot gradient ``e_r`` with SGD lr 1, so ``-x[r]`` counts exactly the
pushes of rank ``r`` that were applied, whichever process sent them. Every
wait is bounded (launch deadline, receive timeouts, polling deadlines).
"""

from __future__ import annotations

import os
import struct
import time

import pytest
import torch
import torch.distributed as dist

from gradcomp import ps
from gradcomp.launch import launch
from gradcomp.ps import protocol as P
from gradcomp.ps.auth import Credential
from gradcomp.ps.sharding import layout_checksum, param_specs

import ps_peers as PP

PAD = 64


def _params(numel):
    return {"x": torch.zeros(numel), "pad": torch.zeros(PAD)}


def _onehot(numel, r):
    g = torch.zeros(numel)
    g[r] = 1.0
    return {"x": g}


def _sgd1(params):
    return torch.optim.SGD(params, lr=1.0)


def _server(params, **kw):
    server = ps.ParameterServer(params, mode="async", optimizer=_sgd1, worker_timeout=60.0, **kw)
    stats = server.serve()
    return {"stats": stats, "x": server.parameters()["x"].tolist()}


def _write(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _honest_until(world_size, tmp, flag, **kw):
    """Rank 1: pushes e_1 until ``flag`` exists (at least 5 pushes); its pid in ``rank1.pid``."""
    worker = ps.Worker(_params(world_size), timeout=30.0, **kw)
    _write(os.path.join(tmp, "rank1.pid"), str(os.getpid()))
    accepted, t_end = 0, time.monotonic() + 90.0
    with worker:
        worker.pull()
        while accepted < 5 or not os.path.exists(flag):
            assert time.monotonic() < t_end, "the other rank never finished"
            accepted += worker.push(_onehot(world_size, 1)).accepted
            worker.pull()
            time.sleep(0.01)
        worker.pull()
    return {"accepted": accepted}


def _join_as_rank_2(world_size, addresses, credential):
    """Rank 2 at last joins as itself (so that the server's run ends): one push."""
    with ps.Worker(_params(world_size), rank=2, server_addresses=addresses, credential=credential) as w:
        w.pull()
        return w.push(_onehot(world_size, 2)).accepted


def _expect(error, fn):
    """``(message, seconds)`` of the ``error`` ``fn()`` raises."""
    t0 = time.monotonic()
    with pytest.raises(error) as e:
        fn()
    return str(e.value), time.monotonic() - t0


def _intruders_rank(rank, world_size, tmp):
    dist.barrier()
    params = _params(world_size)
    flag = os.path.join(tmp, "intruders-done")
    if rank == 0:
        return _server(params)
    if rank == 1:
        return _honest_until(world_size, tmp, flag)
    addresses, credential = PP.server_addresses()
    PP.wait_until(lambda: os.path.exists(os.path.join(tmp, "rank1.pid")), 60.0, "rank 1's start")
    pid1 = open(os.path.join(tmp, "rank1.pid")).read()
    layout = layout_checksum(param_specs(params))
    out = {}
    # no credential, and another job's credential, both claiming routing id and user "w1": refused at the handshake
    for name, cred in (("none", None), ("foreign", ps.new_credential())):
        peer = PP.RawPeer(addresses[0], 1, layout, credential=cred, ident=b"w1")
        peer.request(P.HELLO)
        out[name] = peer.handshake()
        out[name + "_reply"] = peer.recv(timeout=1.0)
        peer.close()
    # the job's credential for rank 1, from another process: a made-up session, garbage, then a HELLO
    peer = PP.RawPeer(addresses[0], 1, layout, credential=credential)
    peer.request(P.PUSH, P.pack_bundle([torch.zeros(4, dtype=torch.uint8)]).numpy().tobytes())
    h, text = peer.recv()
    out["made_up_session"] = (P.KIND_NAMES[h.kind], h.status, text.decode())
    peer.send(b"garbage")
    h, text = peer.recv()
    out["garbage"] = (P.KIND_NAMES[h.kind], text.decode())
    peer.request(P.HELLO, P.process_description())
    h, text = peer.recv()
    out["raw_hello"] = (P.KIND_NAMES[h.kind], h.status, text.decode())
    peer.close()
    # the same through the Worker API: a duplicate is refused, wrong credentials are named at once
    x = _params(world_size)
    common = dict(rank=1, server_addresses=addresses, timeout=30.0)
    out["duplicate"] = _expect(ps.RankConflictError, lambda: ps.Worker(x, credential=credential, **common))
    out["wrong"] = _expect(ps.PeerError, lambda: ps.Worker(x, credential=ps.new_credential(), **common))
    out["curve"] = _expect(ps.PeerError, lambda: ps.Worker(x, credential=ps.new_credential(True), **common))
    _write(flag, "")
    out["joined"] = _join_as_rank_2(world_size, addresses, credential)
    return {**out, "pid1": pid1}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_no_process_without_the_credential_gets_in_and_none_displaces_a_live_worker(tmp_path):
    out = launch(_intruders_rank, 3, args=(str(tmp_path),), timeout=120)
    server, x, r1, r2 = out[0]["stats"], out[0]["x"], out[1], out[2]
    # refused at the handshake: nothing of theirs reached the protocol, no reply came back
    # (a peer without credentials sees the mechanism mismatch, or the server hang up first)
    assert r2["none"] in ("HANDSHAKE_FAILED_PROTOCOL", "HANDSHAKE_FAILED_NO_DETAIL") and r2["none_reply"] is None
    assert (r2["foreign"], r2["foreign_reply"]) == ("HANDSHAKE_FAILED_AUTH", None)
    refused = server["refused_reasons"]
    assert refused["wrong password"] >= 2  # another job's credential, raw and through Worker
    # no credential, or a CURVE one: the server sees the mechanism mismatch, or the peer hang up first
    mismatched = refused.get("no credential or another mechanism", 0) + refused.get("handshake not completed", 0)
    assert mismatched >= 2 and server["refused_connections"] >= 4, refused
    # with the job's credential, still no way to take rank 1 from its live process
    assert r2["made_up_session"][:2] == ("EVICTED", P.UNKNOWN_SESSION)
    assert "serves another process of this rank" in r2["made_up_session"][2]
    assert r2["garbage"][0] == "EVICTED" and "protocol error" in r2["garbage"][1]
    kind, status, text = r2["raw_hello"]
    assert (kind, status) == ("EVICTED", P.RANK_IN_USE)
    assert f"worker rank 1 is held by a live process (incarnation 0, pid {r2['pid1']} on host" in text
    message, seconds = r2["duplicate"]
    assert "worker rank 1 is held by a live process" in message and "incarnation=1" in message
    message, seconds = r2["wrong"]
    assert "refused this process's credential at the handshake" in message and seconds < 10
    message, seconds = r2["curve"]
    assert "another security mechanism" in message and "CURVE" in message and seconds < 10
    reasons = server["rejected_reasons"]
    assert reasons["rank_in_use"] == 2 and reasons["session"] == 1 and reasons["protocol"] == 1
    # rank 1 never noticed: one session, every push applied once
    assert server["workers"][1]["sessions"] == 1 and server["workers"][1]["taken_over"] == 0
    assert -x[1] == r1["accepted"] == server["workers"][1]["accepted"]
    assert r2["joined"] and x[2] == -1.0 and x[0] == 0.0
    assert server["done_workers"] == [1, 2] and server["dead_workers"] == {}


def _takeover_rank(rank, world_size, tmp):
    dist.barrier()
    params = _params(world_size)
    started, told = os.path.join(tmp, "rank1-started"), os.path.join(tmp, "taken-over")
    if rank == 0:
        return _server(params)
    if rank == 1:  # the older process: trains, then idles while another process takes its rank
        worker = ps.Worker(params, timeout=30.0, heartbeat_interval=0.2)
        _write(os.path.join(tmp, "rank1.pid"), str(os.getpid()))
        worker.pull()
        accepted = sum(worker.push(_onehot(world_size, 1)).accepted for _ in range(5))
        _write(started, "")
        PP.wait_until(lambda: os.path.exists(told), 60.0, "the takeover")
        # its heartbeats (every 0.2 s) are answered: taken over (polled: a loaded host answers late)
        PP.wait_until(lambda: worker._heartbeat.evicted(0) is not None, 15.0, "the takeover notice")
        t0 = time.monotonic()
        try:
            worker.push(_onehot(world_size, 1))
        except ps.RankConflictError as e:
            error = str(e)
        else:
            error = "pushed after the takeover"
        seconds = time.monotonic() - t0
        _write(os.path.join(tmp, "older-told"), "")
        worker.done()
        return {"accepted": accepted, "error": error, "seconds": seconds}
    addresses, credential = PP.server_addresses()
    PP.wait_until(lambda: os.path.exists(started), 60.0, "rank 1's pushes")
    # a newer incarnation of rank 1, in this (another) live process
    with ps.Worker(_params(world_size), rank=1, incarnation=1, server_addresses=addresses,
                   credential=credential, timeout=30.0) as newer:
        before = newer.accepted_before[0]
        _write(told, "")
        newer.pull()
        accepted = sum(newer.push(_onehot(world_size, 1)).accepted for _ in range(4))
        newer.pull()
        PP.wait_until(lambda: os.path.exists(os.path.join(tmp, "older-told")), 60.0, "the older process's error")
    return {"before": before, "accepted": accepted, "pid": os.getpid(),
            "joined": _join_as_rank_2(world_size, addresses, credential)}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_newer_incarnation_takes_a_live_rank_over_and_the_older_process_is_told(tmp_path):
    out = launch(_takeover_rank, 3, args=(str(tmp_path),), timeout=120)
    server, x, old, new = out[0]["stats"], out[0]["x"], out[1], out[2]
    assert old["error"].startswith("request to server rank 0: worker rank 1 was taken over by a newer "
                                   f"process (incarnation 1, pid {new['pid']} on host"), old["error"]
    assert "from 127.0.0.1" in old["error"] and "heartbeat" not in old["error"]
    assert old["seconds"] < 1.0  # told at once by its heartbeats, not after a timeout
    assert server["rejected_reasons"].get("session", 0) == 0  # its push never left: it knew already
    w1 = server["workers"][1]
    assert (w1["sessions"], w1["taken_over"], w1["incarnation"], w1["status"]) == (2, 1, 1, "done")
    assert new["before"] == old["accepted"] == 5 and new["accepted"] == 4
    assert -x[1] == 9 == w1["accepted"]  # both processes' pushes, each applied once
    assert server["done_workers"] == [1, 2] and server["dead_workers"] == {}


def _tapped_rank(rank, world_size, encrypt):
    dist.barrier()
    params = _params(world_size)
    if rank == 0:
        return _server(params, encrypt=encrypt)
    if rank == 1:
        with ps.Worker(params, timeout=30.0) as worker:
            worker.pull()
            accepted = sum(worker.push(_onehot(world_size, 1)).accepted for _ in range(3))
            worker.pull()
        return {"accepted": accepted}
    addresses, credential = PP.server_addresses()
    tap = PP.Tap(addresses[0])  # rank 2's requests pass an on-path observer
    try:
        with ps.Worker(params, rank=2, server_addresses=[tap.address], credential=credential,
                       timeout=30.0) as worker:
            worker.pull()
            g = {"x": torch.full((world_size,), 0.0).index_fill_(0, torch.tensor([2]), 1.0),
                 "pad": torch.full((PAD,), 1234.5)}
            accepted = sum(worker.push(g).accepted for _ in range(3))
            worker.pull()
    finally:
        tap.close()
    captured = bytes(tap.captured)
    return {"accepted": accepted, "nbytes": len(captured),
            "magic": struct.pack("<q", P.MAGIC) in captured,
            "gradient": struct.pack("<4f", *[1234.5] * 4) in captured,
            "password": Credential(credential).plain_password(2) in captured,
            "credential": credential}


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("encrypt", [False, True])
def test_curve_encrypts_every_message_and_plain_does_not(encrypt):
    out = launch(_tapped_rank, 3, args=(encrypt,), timeout=120)
    server, x, tapped = out[0]["stats"], out[0]["x"], out[2]
    assert server["security"] == ("curve" if encrypt else "plain")
    assert tapped["credential"].startswith("gcps-curve-" if encrypt else "gcps-plain-")
    assert out[1]["accepted"] == tapped["accepted"] == 3 and x == [0.0, -3.0, -3.0]
    assert tapped["nbytes"] > 3 * 4 * PAD  # the observer saw the pushes go by
    # PLAIN: the observer reads the headers, the gradients and rank 2's password; CURVE: none of them
    seen = (tapped["magic"], tapped["gradient"], tapped["password"])
    assert seen == ((False, False, False) if encrypt else (True, True, True))
    assert server["done_workers"] == [1, 2]
    assert set(server["refused_reasons"]) <= {"handshake not completed"}  # none of the job's refused
