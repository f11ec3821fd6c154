"""The agreement's parts without processes: signatures, digests, the message naming a
difference, disagreement envelopes (their pieces, tags and sizes) and the guard
that makes calls of several threads on one group take turns."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest
import torch

from gradcomp.comm import agreement as A
from gradcomp.comm import replay as R
from gradcomp.comm.guard import exclusive
from gradcomp.comm.p2p import MIN_PIECE_BYTES, PIECES, pieces
from gradcomp.meter import TrafficMeter


def test_digest_is_blake2b_of_the_json_items():
    items = (("call", "gradcomp.allreduce"), ("tags or calling threads", "tag 'x'"))
    text = json.dumps(items, separators=(",", ":")).encode()
    expected = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)
    assert A.digest(items) == expected
    assert A.digest((3, 4)) != A.digest((4, 3))


def test_signature_rows():
    sig = A.signature(numel=10, op=1, details={"call": "c"})
    assert sig.row == (10, 1, 0, 0, 0, 0, A.digest((("call", "c"),)))
    assert len(sig.row) * 8 == A.SIGNATURE_NBYTES == 56
    with pytest.raises(ValueError, match="unknown fields"):
        A.signature(numell=3, details={})


def test_call_identity():
    assert A.call_identity(None) == f"thread {threading.current_thread().name!r}"
    assert A.call_identity("grads") == "tag 'grads'" and A.call_identity(3) == "tag 3"
    for bad in (True, 1.5, ("a",)):
        with pytest.raises(TypeError, match="tag must be None, a str or an int"):
            A.call_identity(bad)


def _table(*sigs):
    return [s.row for s in sigs], [s.details for s in sigs]


def test_a_difference_is_named_with_every_ranks_value():
    labels = {"codec": {1: "int8", 2: "fp16"}}
    a = A.signature(numel=100, codec=1, details={"call": "c", "tag": "t"}, labels=labels)
    b = A.signature(numel=99, codec=2, details={"call": "c", "tag": "t"}, labels=labels)
    rows, _ = _table(a, b, a)
    msg = A._difference(rows, None, a)  # equal digests: the details were not exchanged
    assert msg.startswith("c: the ranks of the group passed different numbers of elements "
                          "(rank 0: 100, rank 1: 99, rank 2: 100); they also differ in compressor types")
    assert A._difference([a.row, a.row], None, a) is None


def test_settings_are_named_before_the_sizes_and_calls_before_both():
    a = A.signature(numel=5, details={"call": "c", "layout": "w: shape (2, 3), f32"})
    b = A.signature(numel=6, details={"call": "c", "layout": "w: shape (3, 2), f32"})
    msg = A._difference(*_table(a, b), a)
    assert "different layout (rank 0: w: shape (2, 3), f32; rank 1: w: shape (3, 2), f32)" in msg
    assert "they also differ in numbers of elements" in msg
    c = A.signature(numel=5, details={"call": "other"})
    msg = A._difference(*_table(a, c), a)
    assert msg.startswith("gradcomp: the ranks of the group passed different calls (rank 0: c, rank 1: other)")


class _Comm:
    """What :func:`gradcomp.comm.replay.replay` needs of a Comm: it records the ops."""

    def __init__(self, gloo=True):
        self.ops, self.meter, self.timeout, self.gloo, self.tier = [], TrafficMeter(), 5.0, gloo, None

    def buffer(self, nbytes, device):
        return torch.full((nbytes,), 7, dtype=torch.uint8)

    def post(self, ops):
        self.ops.extend(ops)
        return []


def test_envelopes_follow_the_pieces_and_tags_of_the_pattern():
    big = 3 * MIN_PIECE_BYTES + 5  # cut into 3 pieces when split
    entries = [(((1, big),), ((2, big),), "reduce_scatter", 0, True),
               (((1, big),), (), "reduce_scatter", 64, False),  # the pipelined ring's: uncut
               (((1, 3),), ((2, 3),), "reduce_scatter", 80, False)]  # a 3-byte part
    comm = _Comm()
    rep = R.replay(comm, entries)
    sends = [(buf, tag, peer) for kind, buf, tag, peer in comm.ops if kind == "isend"]
    recvs = [(buf, tag, peer) for kind, buf, tag, peer in comm.ops if kind == "irecv"]
    cuts = pieces(big)
    assert len(cuts) == 3 <= PIECES
    # one envelope per piece the peer posted, on that piece's tag, never longer than it
    assert [(tag, peer, buf.numel()) for buf, tag, peer in sends] == \
        [(i, 1, 8) for i in range(3)] + [(64, 1, 8), (80, 1, 3)]
    assert all(bytes(buf.numpy().tobytes()) == R.ENVELOPE[:buf.numel()] for buf, _, _ in sends)
    # receives at the remembered sizes, piece by piece
    assert [(tag, peer, buf.numel()) for buf, tag, peer in recvs] == \
        [(i, 2, b - a) for i, (a, b) in enumerate(cuts)] + [(80, 2, 3)]
    # what the meter counts: the envelopes sent; received, 8 bytes per piece that got one
    # (simulated: the first piece), the whole piece where a payload came
    recvs[0][0][:8] = torch.frombuffer(bytearray(R.ENVELOPE), dtype=torch.uint8)
    for buf, _, _ in recvs[1:]:
        buf.fill_(1)
    rep.wait()
    ph = comm.meter.as_dict()["phases"]["agreement"]
    assert ph["bytes_sent"] == 3 * 8 + 8 + 3
    assert ph["bytes_received"] == 8 + sum(b - a for a, b in cuts[1:]) + 3


def test_on_nccl_envelopes_are_as_long_as_the_pieces():
    """NCCL matches a receive only with a send of its size."""
    big = 2 * MIN_PIECE_BYTES
    comm = _Comm(gloo=False)
    R.replay(comm, [(((1, big),), ((1, big),), "reduce_scatter", 0, True)]).wait()
    sends = [buf for kind, buf, _, _ in comm.ops if kind == "isend"]
    assert [buf.numel() for buf in sends] == [b - a for a, b in pieces(big)]
    assert all(R.is_envelope(buf) and int(buf[8:].sum()) == 0 for buf in sends)
    ph = comm.meter.as_dict()["phases"]["agreement"]
    assert ph["bytes_sent"] == ph["bytes_received"] == big


def test_the_rest_of_a_pattern_skips_what_a_call_posted():
    pattern = [((), (), "reduce_scatter", t, True) for t in range(4)]
    trace = pattern[:2] + [((), (), "allgather", 9, True)]
    assert R.rest_of(pattern, trace) == pattern[2:]
    assert R.is_envelope(torch.frombuffer(bytearray(R.ENVELOPE + b"x"), dtype=torch.uint8))
    assert not R.is_envelope(torch.frombuffer(bytearray(b"GCMP0000"), dtype=torch.uint8))
    with pytest.raises(R.Disagreement):
        R.raise_if_envelope(torch.frombuffer(bytearray(R.ENVELOPE), dtype=torch.uint8))


def test_a_second_thread_waits_for_the_group():
    group, order, holding = object(), [], threading.Event()

    def first():
        with exclusive(group, "first"):
            holding.set()
            order.append("first in")
            time.sleep(0.3)
            order.append("first out")

    t = threading.Thread(target=first)
    t.start()
    holding.wait(5)
    with exclusive(group, "second", timeout=5):
        order.append("second in")
    t.join(5)
    assert order == ["first in", "first out", "second in"]


def test_the_guard_names_the_holder_after_its_timeout_and_refuses_reentry():
    group, release, holding = object(), threading.Event(), threading.Event()

    def hold():
        with exclusive(group):
            holding.set()
            release.wait(5)

    t = threading.Thread(target=hold, name="holder")
    t.start()
    holding.wait(5)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="in use by thread 'holder' .* for more than 0.2 s"):
        with exclusive(group, timeout=0.2):
            pass
    assert 0.2 <= time.perf_counter() - t0 < 2
    release.set()
    t.join(5)
    with exclusive(group):
        with pytest.raises(RuntimeError, match="already in a gradcomp collective"):
            with exclusive(group):
                pass
