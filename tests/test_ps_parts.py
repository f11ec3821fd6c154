"""The parameter server's parts on their own, in one process: the update rule
(gradcomp.ps.apply), failure detection and the holder of a rank
(gradcomp.ps.membership), credentials (gradcomp.ps.auth) and shard
checkpoints (gradcomp.ps.checkpoint). Expected values are worked out by hand."""

from __future__ import annotations

import functools

import pytest
import torch

import gradcomp as gc
from gradcomp.ps import checkpoint as ckpt
from gradcomp.ps import protocol as P
from gradcomp.ps.apply import Rejected, ShardUpdater, check_pull_compressor
from gradcomp.ps.auth import Credential, new_credential
from gradcomp.ps.membership import JOIN, REFUSE, TAKE_OVER, Peer, claim, expired, peer_table
from gradcomp.ps.sharding import param_specs

CPU = torch.device("cpu")


def _updater(tensors, **kw):
    return ShardUpdater(param_specs(tensors), tensors, CPU, **kw)


def _bundle(tensors, codec=None):
    codec = codec or gc.NoCompression()
    return P.pack_bundle([codec.compress(t).wire for t in tensors])


def test_step_scales_lr_by_staleness_and_restores_it():
    u = _updater({"w": torch.tensor([1.0, 2.0])}, optimizer=functools.partial(torch.optim.SGD, lr=0.5),
                 staleness_lr=True)
    u.step({"w": torch.tensor([4.0, -8.0])}, staleness=3)  # lr 0.5 / (1 + 3) = 0.125
    assert u.params["w"].tolist() == [0.5, 3.0]
    assert u.optimizer.param_groups[0]["lr"] == 0.5 and u.params["w"].grad is None
    u.step({"w": torch.tensor([4.0, -8.0])}, staleness=0)
    assert u.params["w"].tolist() == [-1.5, 7.0]


def test_step_clips_the_shard_norm():
    u = _updater({"a": torch.zeros(1), "b": torch.zeros(1)},
                 optimizer=functools.partial(torch.optim.SGD, lr=1.0), clip_grad_norm=1.0)
    assert u.step({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, 0)  # norm 5 -> 1
    assert u.params["a"].item() == pytest.approx(-0.6, rel=1e-5)
    assert u.params["b"].item() == pytest.approx(-0.8, rel=1e-5)
    assert not u.step({"a": torch.tensor([0.3]), "b": torch.tensor([0.4])}, 0)  # norm 0.5: kept
    assert u.params["a"].item() == pytest.approx(-0.9, rel=1e-5)


def test_default_optimizer_is_sgd_with_momentum_and_a_bad_factory_is_refused():
    u = _updater({"w": torch.zeros(2)})
    assert isinstance(u.optimizer, torch.optim.SGD)
    assert u.optimizer.defaults["lr"] == 0.01 and u.optimizer.defaults["momentum"] == 0.9
    with pytest.raises(TypeError, match="optimizer must be a callable"):
        _updater({"w": torch.zeros(2)}, optimizer=3)
    with pytest.raises(TypeError, match="optimizer factory must return"):
        _updater({"w": torch.zeros(2)}, optimizer=lambda params: object())


def test_sync_round_averages_every_contributor_once():
    u = _updater({"w": torch.zeros(2)})
    u.add_to_round(5, {"w": torch.tensor([1.0, 2.0])})
    assert not u.round_complete({5, 6})
    u.add_to_round(6, {"w": torch.tensor([3.0, 6.0])})
    assert u.round_complete({5, 6}) and u.round_complete({5}) and not u.round_complete({5, 7})
    assert u.take_round_average()["w"].tolist() == [2.0, 4.0]
    assert u.contributors == set() and not u.round_complete(set())


def test_decode_push_validates_before_use():
    u = _updater({"a": torch.zeros(2, 2), "b": torch.zeros(3)})
    good = u.decode_push(_bundle([torch.ones(2, 2), torch.tensor([1.0, -2.0, 3.0])]))
    assert good["b"].tolist() == [1.0, -2.0, 3.0] and good["a"].shape == (2, 2)
    cases = {
        "payload": [None, torch.arange(40, dtype=torch.uint8)],
        "shape": [_bundle([torch.ones(4), torch.ones(3)])],
        "nonfinite": [_bundle([torch.ones(2, 2), torch.tensor([1.0, float("nan"), 0.0])])],
    }
    for reason, datas in cases.items():
        for data in datas:
            with pytest.raises(Rejected) as e:
                u.decode_push(data)
            assert e.value.reason == reason


def test_pull_is_full_first_then_a_delta_that_moves_the_mirror_exactly():
    u = _updater({"w": torch.linspace(-1, 1, 300)}, compress_pull=True,
                 pull_compressor=check_pull_compressor(None, True))
    wires, status, mirror = u.encode_pull(None, want_full=False)
    assert status == P.FULL and torch.equal(mirror["w"], u.params["w"].detach())
    with torch.no_grad():
        u.params["w"].add_(torch.linspace(0, 0.3, 300))
    before = mirror["w"].clone()
    wires, status, mirror = u.encode_pull(mirror, want_full=False)
    assert status == P.DELTA
    delta = torch.zeros(300)
    gc.Int8Quantizer().decompress_add_(gc.decode(wires[0]), delta)
    assert torch.equal(mirror["w"], before + delta)  # the replica gets the same bytes
    err = (u.params["w"].detach() - mirror["w"]).abs().max().item()
    assert 0 < err <= 0.3 / 127  # one int8 step of the delta's absmax at most
    assert u.encode_pull(mirror, want_full=True)[1] == P.FULL


def test_pull_without_compress_pull_keeps_no_mirror():
    u = _updater({"w": torch.ones(3)})
    wires, status, mirror = u.encode_pull(None, want_full=False)
    assert status == P.FULL and mirror is None
    assert gc.decode(wires[0]).codec == "raw"


def test_pull_compressor_default_and_unwrapping():
    assert isinstance(check_pull_compressor(None, False), gc.NoCompression)
    q = gc.Int8Quantizer()
    assert check_pull_compressor(gc.ErrorFeedback(q), True) is q
    with pytest.raises(TypeError, match="pull_compressor"):
        check_pull_compressor("int8", True)


def test_expired_names_each_deadline_and_reads_status_as_it_goes():
    peers, by_user = peer_table([3, 4, 5, 6])
    assert by_user["w4"] is peers[4] and peers[4].user == "w4"
    for p in peers.values():
        p.heard = p.clock = 100.0
    peers[3].session = 1                       # connected, no heartbeat for 11 s
    peers[4].clock = 80.0                      # never connected, silent for 30 s
    peers[5].clock, peers[5].deferred = 50.0, P.Header(P.PULL, 5)  # held back by the server: exempt
    peers[6].status = "done"
    found = list(expired(peers.values(), 111.0, heartbeat_timeout=10.0, worker_timeout=20.0))
    assert [(p.rank, r.split(" ")[0]) for p, r in found] == [(3, "no"), (4, "silent")]
    assert "heartbeat_timeout=10 s" in found[0][1] and "worker_timeout=20 s" in found[1][1]
    it = expired(peers.values(), 111.0, 10.0, 20.0)
    first, _ = next(it)
    peers[4].declare_dead("gone")              # acted on before the next is checked
    assert first.rank == 3 and list(it) == []


def test_join_revives_a_dead_worker_unless_the_run_failed():
    p = Peer(7, mirror={"w": torch.ones(1)})
    p.declare_dead("no heartbeat")
    assert (p.status, p.mirror, p.deferred) == ("dead", None, None)
    p.join(P.Header(P.HELLO, 7, seq=1, session=42), now=5.0, run_failed=True)
    assert p.status == "dead" and (p.session, p.sessions, p.heard, p.clock) == (42, 1, 5.0, 5.0)
    p.join(P.Header(P.HELLO, 7, seq=1, session=43), now=6.0, run_failed=False)
    assert (p.status, p.reason, p.sessions) == ("active", "", 2)


def test_claim_lets_a_newer_incarnation_or_a_successor_of_a_gone_holder_in():
    p = Peer(2)
    assert claim(p, 0, holder_connected=False) == JOIN  # nobody holds the rank yet
    p.join(P.Header(P.HELLO, 2, seq=1, session=42, aux=1), now=1.0, run_failed=False, route=b"r1",
           origin="incarnation 1, pid 7")
    assert (p.incarnation, p.route, p.origin) == (1, b"r1", "incarnation 1, pid 7")
    assert claim(p, 0, holder_connected=True) == REFUSE   # a duplicate, or an older process
    assert claim(p, 1, holder_connected=True) == REFUSE   # the same incarnation is a duplicate
    assert claim(p, 2, holder_connected=True) == TAKE_OVER
    assert claim(p, 0, holder_connected=False) == JOIN  # the holder's connection closed: it exited
    for status in ("dead", "done", "aborted"):
        p.status = status
        assert claim(p, 0, holder_connected=True) == JOIN
    p.status = "active"
    for session in range(43, 43 + 10):  # the last 8 displaced sessions are remembered
        p.displace(P.TAKEN_OVER, f"taken over from {p.session}")
        p.join(P.Header(P.HELLO, 2, seq=1, session=session), now=2.0, run_failed=False)
    assert list(p.displaced) == list(range(44, 52)) and p.displaced[51] == (P.TAKEN_OVER, "taken over from 51")


def test_credentials_prove_one_rank_and_nothing_else():
    plain, curve = Credential(new_credential()), Credential(new_credential(encrypt=True))
    assert (plain.mechanism, plain.encrypt, curve.mechanism, curve.encrypt) == ("plain", False, "curve", True)
    assert plain.text not in repr(plain)
    v = plain.verifier([2, 3])
    assert v.check(b"PLAIN", [b"w2", plain.plain_password(2)]) == (b"w2", "")
    assert v.check(b"PLAIN", [b"w2", plain.plain_password(3)]) == (None, "wrong password")  # another rank's
    assert v.check(b"PLAIN", [b"w4", plain.plain_password(4)])[0] is None  # not a worker rank of the job
    other = Credential(new_credential())
    assert v.check(b"PLAIN", [b"w2", other.plain_password(2)]) == (None, "wrong password")
    assert v.check(b"CURVE", [b"\0" * 32])[1].startswith("mechanism CURVE")
    import zmq
    from zmq.utils import z85

    key = z85.decode(curve.curve_keys("w3")[0])
    cv = curve.verifier([2, 3])
    assert cv.check(b"CURVE", [key]) == (b"w3", "")
    foreign = Credential(new_credential(encrypt=True)).curve_keys("w3")[0]  # rank 3 of another job
    assert cv.check(b"CURVE", [z85.decode(foreign)]) == (None, "unknown CURVE key")
    assert cv.check(b"PLAIN", [b"w3", b"x"])[0] is None
    public, secret = curve.curve_keys("server0")
    assert zmq.curve_public(secret) == public and len(public) == 40
    assert curve.server_options(0)[zmq.CURVE_SERVER] == 1
    assert plain.client_options(5, 0) == {zmq.PLAIN_USERNAME: b"w5", zmq.PLAIN_PASSWORD: plain.plain_password(5)}
    for bad in ("gcps-plain-xyz", "gcps-rsa-" + "0" * 64, "plain-" + "0" * 64, "gcps-plain-" + "A" * 64):
        with pytest.raises(ValueError, match="credential must be 'gcps-plain-<64 hex digits>'"):
            Credential(bad)
    with pytest.raises(TypeError, match="credential must be a string"):
        Credential(b"gcps")


def test_shard_checkpoint_round_trip(tmp_path):
    mk = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    u = _updater({"w": torch.tensor([1.0, 2.0])}, optimizer=mk)
    u.step({"w": torch.tensor([1.0, 1.0])}, 0)  # w = [0.9, 1.9], momentum buffer [1, 1]
    path = ckpt.save_shard(str(tmp_path), 2, 3, "async", u, version=17)
    assert path == str(tmp_path / "ps-server-2.pt")
    fresh = _updater({"w": torch.zeros(2)}, optimizer=mk)
    assert ckpt.resume_shard(str(tmp_path), 2, 3, fresh) == 17
    assert fresh.params["w"].tolist() == pytest.approx([0.9, 1.9])
    assert fresh.optimizer.state[fresh.params["w"]]["momentum_buffer"].tolist() == [1.0, 1.0]
    assert ckpt.resume_shard(str(tmp_path), 0, 3, fresh) is None  # no file: nothing changes
    with pytest.raises(gc.ps.CheckpointError, match="another parameter placement"):
        ckpt.resume_shard(str(tmp_path), 2, 4, fresh)
