"""TrafficMeter.tier_scope: untiered records inside the block count in its tier, per thread."""

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
