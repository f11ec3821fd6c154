"""TrafficMeter: tier_scope (untiered records inside the block count in its tier, per thread) and
the event counters (counted by kind, added by merge, cleared by reset)."""

from __future__ import annotations

import threading

import pytest

import gradcomp as gc


def test_tier_scope_counts_untiered_records_in_its_tier():
    meter = gc.TrafficMeter()
    meter.record_send(10, 40, phase="a")  # outside: no tier
    with meter.tier_scope("inter_host"):
        meter.record_send(7, 28, phase="a")
        meter.record_recv(5, phase="b")
        meter.record_send(3, phase="b", tier="intra_host")  # an explicit tier is kept
        with meter.tier_scope("intra_host"):
            meter.record_send(2, phase="b")
        meter.record_time(0.5, phase="a")  # the outer scope is back
    meter.record_send(1, phase="a")
    d = meter.as_dict()
    assert d["tiers"]["inter_host"]["bytes_sent"] == 7 and d["tiers"]["inter_host"]["raw_bytes_sent"] == 28
    assert d["tiers"]["inter_host"]["bytes_received"] == 5 and d["tiers"]["inter_host"]["seconds"] == 0.5
    assert d["tiers"]["intra_host"]["bytes_sent"] == 3 + 2
    assert d["bytes_sent"] == 10 + 7 + 3 + 2 + 1  # phase totals unchanged


def test_tier_scope_is_per_thread_and_checks_the_tier():
    meter = gc.TrafficMeter()
    with meter.tier_scope("inter_host"):
        t = threading.Thread(target=meter.record_send, args=(11,))
        t.start()
        t.join(timeout=30)
    assert meter.bytes_sent == 11 and meter.as_dict()["tiers"] == {}
    with pytest.raises(ValueError, match="tier"):
        with meter.tier_scope("rack"):
            pass


def test_events_are_counted_merged_and_reset():
    a = gc.TrafficMeter()
    a.record_event("push_dropped")
    a.record_event("push_dropped", 2)
    a.record_event("quorum_change", 0)
    assert a.as_dict()["events"] == {"push_dropped": 3, "quorum_change": 0}
    b = gc.TrafficMeter()
    b.record_event("quorum_change")
    b.merge(a)  # each rank counts its own: merged counts add
    b.merge(a.as_dict())
    assert b.as_dict()["events"] == {"push_dropped": 6, "quorum_change": 1}
    assert b.bytes_sent == 0 and b.as_dict()["phases"] == {}  # events are not bytes
    b.reset()
    assert b.as_dict()["events"] == {}


def test_a_dict_without_events_merges():
    m = gc.TrafficMeter()
    m.record_event("step_rolled_back")
    m.merge({"phases": {}, "steps": 0})  # an as_dict() written before events existed
    assert m.as_dict()["events"] == {"step_rolled_back": 1}


@pytest.mark.parametrize("kind, count, error", [("", 1, TypeError), (3, 1, TypeError), ("x", -1, ValueError),
                                                ("x", 1.5, ValueError), ("x", True, ValueError)])
def test_bad_events_name_the_argument(kind, count, error):
    with pytest.raises(error, match="kind" if error is TypeError else "count"):
        gc.TrafficMeter().record_event(kind, count)
