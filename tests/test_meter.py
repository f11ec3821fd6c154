"""TrafficMeter's event counters: counted by kind, added by merge, cleared by reset."""

from __future__ import annotations

import pytest

import gradcomp as gc


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
