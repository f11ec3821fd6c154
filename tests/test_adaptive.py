"""Adaptive compression (gradcomp.adaptive): the decision rule, its arguments,
the meter's switch log, and 2-rank gloo runs with injected link timings.

The injected link: a rank's communication time is the bytes it really sent
(its meter's count, as the policy reports it in ``Timing.wire_bytes``)
divided by a link rate that the test sets per step, plus the slowest rank's
kernel cost; its compute time is a constant of the test. Rank 0 computes
slower, so rank 1 also waits for it in every collective; the link slows down
for both. Only the agreed numbers (min communication: the collective without
the wait, min compute, max kernel cost over the ranks) make both ranks
switch at the steps the test derives by hand below. With the max
communication (rank 1's wait read as link time), or without the wait in the
predicted steps, the DDP run goes from none straight to top-k and misses the
recovery (top-k's time then moves by less than 2x), and the collective never
returns to none (int8 measured with the wait predicts none at 8.8 C).
"""

import dataclasses
import pickle
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp as gc
from gradcomp.adaptive import Adaptive, Timing, choose, fit_link, start
from gradcomp.ddp import GradCompState, compressed_allreduce_hook
from gradcomp.launch import launch

TIMEOUT = 120

# ---- the decision rule ---------------------------------------------------------


NB = [4000, 2000, 1000, 50]  # wire bytes of none, fp16, int8, top-k + int8 on a small bucket
C = 0.010                    # agreed compute: 10 ms
F1 = [1.0, 1.0, 1.0, 1.0]
FD = [1.0, 1.0, 1.0, 1.47]   # the default factors
Z = [0.0, 0.0, 0.0, 0.0]
MS = 1e-3


@pytest.mark.parametrize("level, comm_ms, kernel_ms, seen_ms, conv, allowed, expected", [
    # Every factor 1, zero kernel costs: the old ladder. Costs in ms: the step is
    # 10 + max(0, T - 10); unmeasured lighter codecs get 2x (upper / lower) their link time;
    # the choice is the lightest within 10% of the least cost.
    (0, 4.0, Z, {}, F1, True, 0),      # none hidden (4 <= 10): every cost 10: the lightest
    (0, 100.0, Z, {}, F1, True, 3),    # 0.025 ms/B: fp16 50, int8 25, top-k 1.25 -> 10: only top-k <= 11
    (0, 30.0, Z, {}, F1, True, 2),     # 0.0075 ms/B: fp16 15, int8 7.5 -> 10: int8 is the lightest <= 11
    (3, 0.05, Z, {}, F1, True, 0),     # 0.001 ms/B: none 2 x 4 = 8 -> 10: back to none at once
    (3, 0.075, Z, {}, F1, True, 1),    # 0.0015 ms/B: none 2 x 6 = 12 > 11; fp16 2 x 3 = 6 -> 10
    (3, 0.05, Z, {}, F1, False, 3),    # waiting after a heavier move: lighter ones left out
    (2, 20.0, Z, {0: 15.0}, F1, False, 0),  # ... unless measured: int8 20 > none 15: back at once
    (2, 3.0, Z, {}, F1, True, 2),      # int8 0.003 ms/B: fp16 2 x 6 = 12 > 11: stay (the band)
    (2, 2.0, Z, {}, F1, True, 1),      # fp16 2 x 4 = 8 -> 10
    # byte-independent costs (kernel 1 ms for fp16 and int8, 20 ms for top-k), slow link:
    (0, 100.0, [0, 1, 1, 20], {}, FD, True, 2),  # int8 1 + 25 = 26; top-k 20 + 1.25 = 21.25 x 1.47 = 31.2
    # no kernel costs: int8 25, top-k 10 x 1.47 = 14.7: int8 converges faster and is within
    # 2 x (upper / lower) 14.7: measured on the way; once measured at 25, on to top-k
    (0, 100.0, Z, {}, FD, True, 2),
    (2, 25.0, Z, {0: 100.0}, FD, True, 3),
    (0, 100.0, Z, {}, [1, 1, 1, 3.0], True, 2),  # top-k 30: int8 (25) is the best outright
    (0, 100.0, [0, 1, 1, 20], {}, F1, True, 3),  # no convergence cost: top-k 21.25 < int8 26
    # only top-k hides (0.05 ms/B): fp16 1 + 100, int8 1 + 50 = 51, top-k 2 + 2.5 -> 10 x 1.47 = 14.7
    (0, 200.0, [0, 1, 1, 2], {}, FD, True, 3),
    (0, 200.0, [0, 1, 1, 2], {}, [1, 1, 1, 6.0], True, 2),  # factor 6: top-k 60 > int8 51
    # measured codecs: their own times, and the link fitted to them (alpha per collective +
    # beta per byte). int8 measured 20 ms: alpha 16.67 ms + 1/300 ms per byte: fp16 16.67 +
    # 6.67 = 23.3, top-k 16.67 + 0.17 = 16.8 x 1.47 = 24.7: int8 (20 <= 22)
    (0, 30.0, Z, {2: 20.0}, FD, True, 2),
    (3, 0.1, Z, {}, F1, True, 1),          # 0.002 ms/B: none 2 x 8 = 16; fp16 2 x 4 = 8 -> 10
    (3, 0.1, Z, {0: 9.0}, F1, True, 0),    # none measured 9 -> 10
    # int8 measured 30 (cost 30), fp16 measured 32: within 10% of the best, but a measured
    # lighter codec must cost no more than the current one: int8 stays (no trading places)
    (2, 30.0, Z, {1: 32.0}, F1, True, 2),
    (2, 32.0, Z, {1: 30.0}, F1, False, 1),  # fp16 measured cheaper: back to it (none, unmeasured, waits)
    # a latency-bound link (a loaded host): none 16 ms, int8 19 ms: the bytes do not show,
    # alpha 17.5 ms, beta 0: fp16 17.5, top-k 17.5 x 1.47: none (16) stays
    (0, 16.0, Z, {2: 19.0}, FD, True, 0),
    (0, 16.0, Z, {}, FD, True, 1),         # none alone: all per byte: fp16 8, int8 4 -> 10: fp16
])
def test_choose(level, comm_ms, kernel_ms, seen_ms, conv, allowed, expected):
    new, _, _ = choose(level, comm_ms * MS, C, [k * MS for k in kernel_ms], NB,
                    {j: t * MS for j, t in seen_ms.items()}, conv, upper=1.0, lower=0.5,
                    lighter_allowed=allowed)
    assert new == expected


def test_choose_fits_the_link_per_kind_of_collective():
    # int8 (ring) measured 30 ms, top-k (allgather) 34 ms: over both the bytes do not show
    # (negative slope: alpha 32 ms, beta 0), so none and fp16 are predicted at 32 -> step 32,
    # cost 32 <= 1.1 x 30: the lightest, none. Per kind: the dense codecs from int8 alone,
    # 0.03 ms/B, lighter ones 2x: fp16 120, none 240 -> int8 stays.
    args = (2, 30 * MS, C, Z, NB, {3: 34 * MS}, FD)
    assert choose(*args, upper=1.0, lower=0.5)[0] == 0
    new, preds, link = choose(*args, upper=1.0, lower=0.5, sparse=[False, False, False, True])
    assert new == 2
    assert [p["comm_s"] / MS for p in preds] == pytest.approx([240, 120, 30, 34])
    assert link == (0, pytest.approx(0.03 * MS))
    # a sparse codec with none of its kind measured: from every measured codec (int8 alone,
    # 0.03 ms/B): top-k 1.5 ms, hidden: cost 10 x 1.47 = 14.7 < 30; int8 measured: top-k
    new, preds, _ = choose(2, 30 * MS, C, Z, NB, {}, FD, upper=1.0, lower=0.5, sparse=[False, False, False, True])
    assert new == 3 and preds[3]["comm_s"] == pytest.approx(1.5 * MS)


def test_choose_reports_its_predictions():
    _, preds, link = choose(0, 0.1, C, [0, 1e-3, 1e-3, 0.02], NB, {}, FD, upper=1.0, lower=0.5)
    assert link == (0, pytest.approx(0.1 / 4000))
    assert [p["comm_s"] for p in preds] == pytest.approx([0.1, 0.051, 0.026, 0.02125])
    assert [p["step_s"] for p in preds] == pytest.approx([0.1, 0.051, 0.026, 0.02125])
    assert [p["cost_s"] for p in preds] == pytest.approx([0.1, 0.051, 0.026, 0.02125 * 1.47])
    # no compute to hide behind: every second of communication is exposed
    _, preds, _ = choose(1, 0.004, 0.0, [0, 0, 0, 0], NB, {}, F1, upper=1.0, lower=0.5)
    assert [p["step_s"] for p in preds] == pytest.approx([0.016, 0.004, 0.002, 0.0001])


@pytest.mark.parametrize("points, expected", [
    ([(4000, 30.0), (1000, 20.0)], (50 / 3, 1 / 300)),        # the line through both
    ([(1000, 3.0), (2000, 5.0), (4000, 9.0)], (1.0, 0.002)),  # an exact line
    ([(4000, 16.0), (1000, 19.0)], (17.5, 0.0)),              # negative slope: all latency, the mean
    # negative intercept: all per byte, the slope through 0: (50 x 0.1 + 4000 x 9) / (50^2 + 4000^2)
    ([(50, 0.1), (4000, 9.0)], (0.0, 36005 / 16002500)),
    ([(100, 1.0)], (0.0, 0.01)),                               # one byte count: all per byte
    ([(100, 1.0), (100, 3.0)], (0.0, 0.02)),
    ([(100, -1.0)], (0.0, 0.0)),                               # (kernel timing above the collective's)
    ([(0, 1.0)], (0.0, 0.0)), ([], (0.0, 0.0)),                # nothing sent (one rank)
])
def test_fit_link(points, expected):
    assert fit_link(points) == pytest.approx(expected)


@pytest.mark.parametrize("points, expected", [
    ([(1000, 0.02)], (0.008, 1.2e-5)),                # prior time 0.004 + 0.006 = 0.01: scaled by 2
    ([(1000, 0.01), (1000, 0.03)], (0.008, 1.2e-5)),  # one byte count: the mean, as above
    ([(4000, 30.0), (1000, 20.0)], (50 / 3, 1 / 300)),  # two byte counts: fitted, the prior unused
])
def test_fit_link_splits_a_single_byte_count_as_the_prior_does(points, expected):
    assert fit_link(points, prior=(0.004, 6e-6)) == pytest.approx(expected)
    assert fit_link([(100, 1.0)], prior=(0.0, 0.0)) == (0.0, 0.01)  # an empty prior: all per byte


def test_choose_splits_one_measured_codec_as_the_link_prior_does():
    # int8 measured at 30 ms on a latency-bound link: prior 6 messages x 4 ms + 1000 B / 1e8 B/s.
    # Without the prior all 30 ms count as per byte: none is predicted at 240 ms and top-k
    # (50 B) at 1.5 ms, hidden behind the 10 ms compute: top-k. With it nearly all are per
    # collective: every codec is predicted near 30 ms, and none (bytes x 2, the caution) is
    # within 10% of the least: none
    prior, messages = (0.004, 1e8), [6, 6, 6, 6]
    scale = 0.030 / (6 * 0.004 + 1000 / 1e8)
    alpha, beta = scale * 6 * 0.004, scale / 1e8
    assert choose(2, 0.030, C, Z, NB, {}, F1, upper=1.0, lower=0.5)[0] == 3
    new, preds, link = choose(2, 0.030, C, Z, NB, {}, F1, upper=1.0, lower=0.5, link=prior, messages=messages)
    assert link == (pytest.approx(alpha), pytest.approx(beta))
    assert [p["comm_s"] for p in preds] == pytest.approx(
        [alpha + 4000 * beta * 2, alpha + 2000 * beta * 2, 0.030, alpha + 50 * beta])
    assert new == 0


def test_choose_predicts_the_backends_allreduce_from_the_link_prior_until_it_is_measured():
    # int8 on gradcomp's ring measured at 30 ms, 10 ms of compute; prior 1 us per message,
    # 1e6 B/s. none runs on the backend's allreduce, not measured yet: from the prior alone
    # (6 messages + 4000 B, x 2 as a lighter codec = 8.006 ms, hidden: cost 10 ms, the
    # least: none). fp16 and top-k still come from int8's 30 ms, split as the prior splits
    # it (fp16 x 2 as a lighter codec). Without the prior, or with none measured, none
    # comes from the measurements
    prior, messages = (1e-6, 1e6), [6, 6, 6, 3]
    native, sparse = [True, False, False, False], [False, False, False, True]
    scale = 0.030 / (6e-6 + 1000e-6)  # int8 alone, split as the prior splits it
    new, preds, _ = choose(2, 0.030, C, Z, NB, {}, FD, upper=1.0, lower=0.5, link=prior, messages=messages,
                           native=native, sparse=sparse)
    assert preds[0]["comm_s"] == pytest.approx(6e-6 + 2 * 4000e-6)
    assert preds[1]["comm_s"] == pytest.approx(scale * (6e-6 + 2 * 2000e-6))
    assert preds[3]["comm_s"] == pytest.approx(scale * (6e-6 + 50e-6))  # messages[2]: int8's split
    assert new == 0
    # none's 40 ms measurement (its own kind) outweighs the prior: exposed, cost 40; top-k from
    # the line through none and int8 (26.67 ms + 50 B x 3.33 us/B, exposed: cost 26.83 x 1.47
    # = 39.4); int8 at 30 stays
    new, preds, _ = choose(2, 0.030, C, Z, NB, {0: 0.040}, FD, upper=1.0, lower=0.5, link=prior,
                           messages=messages, native=native, sparse=sparse)
    assert preds[0]["comm_s"] == 0.040 and preds[3]["comm_s"] == pytest.approx(0.080 / 3 + 50 * 0.01 / 3000)
    assert new == 2
    # without the prior: from int8's 30 ms, all per byte, x 2: 240 ms
    new, preds, _ = choose(2, 0.030, C, Z, NB, {}, F1, upper=1.0, lower=0.5, native=native)
    assert preds[0]["comm_s"] == pytest.approx(0.240)
    # measured none (5 ms for 4000 B) predicts the ring kind only while nothing of it is measured
    _, preds, _ = choose(0, 0.005, C, Z, NB, {}, F1, upper=1.0, lower=0.5, link=prior, messages=messages,
                         native=native)
    scale0 = 0.005 / (6e-6 + 4000e-6)
    assert preds[2]["comm_s"] == pytest.approx(scale0 * (6e-6 + 1000e-6))


def test_choose_counts_the_wait_for_the_last_rank_in_every_step():
    # int8 measured at 2.5 C, top-k at 1.3 C (hidden up to C), compute C. Without a wait: int8's
    # step 2.5 C, top-k's 1.3 C x 1.47 = 1.911 C: top-k. Waiting 2 C for the last rank in every
    # step: int8 4.5 C, top-k 3.3 C x 1.47 = 4.851 C: int8 stays (the wait is paid per step,
    # and top-k needs 1.47x the steps)
    kw = dict(upper=1.0, lower=0.5, sparse=[False, False, False, True])
    assert choose(2, 2.5 * C, C, Z, NB, {3: 1.3 * C}, FD, **kw)[0] == 3
    new, preds, _ = choose(2, 2.5 * C, C, Z, NB, {3: 1.3 * C}, FD, wait_s=2 * C, **kw)
    assert new == 2
    assert preds[2]["step_s"] == pytest.approx(4.5 * C) and preds[3]["step_s"] == pytest.approx(3.3 * C)
    assert preds[3]["cost_s"] == pytest.approx(1.47 * 3.3 * C)


def test_the_first_decision_after_a_start_predicts_none_from_the_prior_without_the_caution():
    # the start put the bucket on int8 (gradcomp's ring) on the prior alone (1 us per message,
    # 1e6 B/s); int8 then measured 6 ms, compute 1 ms: int8's step 6 ms. none (the backend's
    # allreduce, not measured): 6 messages + 4000 B = 4.006 ms, x 2 as a lighter codec 8.006.
    # With the caution int8 stays; at the first decision after the start none is predicted
    # as the prior says (step 4.006 ms): none. fp16, of the measured ring kind, keeps it
    # (candidates none, fp16, int8)
    prior, messages, native = (1e-6, 1e6), [6, 6, 6], [True, False, False]
    kw = dict(upper=1.0, lower=0.5, link=prior, messages=messages, native=native)
    new, preds, _ = choose(2, 6e-3, 1e-3, Z[:3], NB[:3], {}, F1[:3], **kw)
    assert new == 2 and preds[0]["comm_s"] == pytest.approx(6e-6 + 2 * 4000e-6)
    new, preds_after, _ = choose(2, 6e-3, 1e-3, Z[:3], NB[:3], {}, F1[:3], after_start=True, **kw)
    assert new == 0 and preds_after[0]["step_s"] == pytest.approx(6e-6 + 4000e-6)
    assert preds_after[1]["comm_s"] == pytest.approx(preds[1]["comm_s"])


def test_a_move_off_the_backends_allreduce_on_predictions_needs_the_caution():
    native, sparse = [True, False, False, False], [False, False, False, True]
    kw = dict(upper=1.0, lower=0.5, sparse=sparse)
    # none measured at 1.5 C, all per byte (no prior): fp16 (0.75 C) and int8 (0.375 C) hide, a
    # step of C, 1.5x shorter, not beyond upper / lower = 2: none stays (not native: fp16)
    new, preds, _ = choose(0, 1.5 * C, C, Z, NB, {}, FD, native=native, **kw)
    assert [p["step_s"] / C for p in preds] == pytest.approx([1.5, 1.0, 1.0, 1.0]) and new == 0
    assert choose(0, 1.5 * C, C, Z, NB, {}, FD, **kw)[0] == 1
    # at 3 C: fp16's 1.5 C and int8's C are 2x and 3x shorter: int8 (fp16 not within 10% of it)
    assert choose(0, 3 * C, C, Z, NB, {}, FD, native=native, **kw)[0] == 2
    # with int8 measured (1.2 C), the ring kind is predicted from it: the usual rule takes int8
    new, preds, _ = choose(0, 1.5 * C, C, Z, NB, {2: 1.2 * C}, FD, native=native, **kw)
    assert preds[1]["comm_s"] == pytest.approx(2.4 * C) and new == 2


# the start under a link prior: kernels 0 / 1 / 2 / 3 ms, messages 2 / 2 / 2 / 1 (ring, allgather)
KS, MSGS = [0.0, 1e-3, 2e-3, 3e-3], [2, 2, 2, 1]


@pytest.mark.parametrize("latency_s, bytes_per_s, conv, expected, comm_ms", [
    # 1 byte/us: none 2 + 4 = 6 ms, fp16 1 + 2 + 2 = 5, int8 2 + 2 + 1 = 5, top-k 3 + 1 + 0.05 (converges
    # slower: not a start); fp16 is the lightest within 10% of 5
    (1e-3, 1e6, FD, 1, [6.0, 5.0, 5.0, 4.05]),
    # 10 us/byte: none 42, fp16 23, int8 14 -> int8; top-k (8.5) only if it converges as fast
    (1e-3, 1e5, FD, 2, [42.0, 23.0, 14.0, 4.5]),
    (1e-3, 1e5, F1, 3, [42.0, 23.0, 14.0, 4.5]),
    # a fast link: none's 0.004 ms beats every kernel
    (0.0, 1e9, FD, 0, [0.004, 1.002, 2.001, 3.00005]),
])
def test_start(latency_s, bytes_per_s, conv, expected, comm_ms):
    new, preds = start(KS, NB, MSGS, conv, latency_s, bytes_per_s)
    assert new == expected
    assert [p["comm_s"] / MS for p in preds] == pytest.approx(comm_ms)


@pytest.mark.parametrize("latency_s, bytes_per_s, caution, expected", [
    (1e-3, 1e6, 2.0, 0),  # none's 6 ms is within 2 x int8's 5: the backend's allreduce stays
    (1e-3, 1e6, 1.1, 1),  # within 1.1 x (6 > 5.5): fp16, as without native
    (1e-3, 1e5, 2.0, 2),  # none's 42 ms is more than 2 x int8's 14: int8
    (1e-3, 1e5, 3.0, 0),  # ... but within 3 x
])
def test_start_leaves_the_backends_allreduce_only_for_more_than_the_caution(latency_s, bytes_per_s, caution,
                                                                              expected):
    native = [True, False, False, False]
    new, _ = start(KS, NB, MSGS, FD, latency_s, bytes_per_s, native=native, caution=caution)
    assert new == expected
    # kernel costs taken as 0 only favour the compressing codecs: a native start there is one here
    zero, _ = start([0.0] * 4, NB, MSGS, FD, latency_s, bytes_per_s, native=native, caution=caution)
    assert zero != 0 or new == 0


def test_convergence_defaults_and_overrides():
    assert Adaptive().convergence == (1.0, 1.0, 1.0, 1.47)
    a = Adaptive(["topk-int8", "int8", gc.TopK(ratio=0.001)], convergence={"topk-int8": 1.3})
    assert a.convergence == (1.3, 1.0, 1.0)  # an instance defaults to 1
    b = Adaptive(["int8", gc.TopK(ratio=0.001)], convergence={repr(gc.TopK(ratio=0.001)): 2})
    assert b.convergence == (1.0, 2.0)
    assert Adaptive(["int8", "none"], convergence={"int8": 1e6, "none": 1e-6}).convergence == (1e6, 1e-6)


def test_hysteresis_waits_and_backs_off_on_reverted_lighter_moves():
    from gradcomp.adaptive import _Track
    t = _Track("b", 100, [0, 1, 2], [400, 100, 5], [2, 2, 1], patience=2, window=3)
    moves = []
    for number, new in enumerate([2, 2, 2, 1, 2, 2, 2, 2, 2, 1, 1]):
        moved = t.hysteresis(new, number, base=2)
        if moved:
            t.level = new
        moves.append((moved, t.hold, t.patience))
    assert moves == [
        (True, 2, 2),    # 0: heavier: lighter moves wait 2 decisions
        (False, 1, 2), (False, 0, 2),
        (True, 0, 2),    # 3: lighter
        (True, 4, 4),    # 4: undone at once: the wait doubles
        (False, 3, 4), (False, 2, 4), (False, 1, 4), (False, 0, 4),
        (True, 0, 4),    # 9: lighter again
        (False, 0, 2),   # 10: it held: the wait is back to the base
    ]


def test_hysteresis_a_refuted_heavier_move_leaves_no_wait():
    from gradcomp.adaptive import _Track
    t = _Track("b", 100, [0, 1, 2], [400, 100, 5], [2, 2, 1], patience=2, window=3)
    t.level = 1
    moves = []
    for number, new in enumerate([2, 1, 0, 0, 1, 2, 2, 1]):
        moved = t.hysteresis(new, number, base=2)
        if moved:
            t.level = new
        moves.append((moved, t.hold, t.patience))
    assert moves == [
        (True, 2, 2),    # 0: heavier (a probe)
        (True, 0, 2),    # 1: refuted and undone at once: no wait
        (True, 0, 2),    # 2: lighter again, at once
        (False, 0, 2),
        (True, 2, 2),    # 4: heavier
        (True, 2, 2),    # 5: heavier again
        (False, 1, 2),
        (True, 1, 2),    # 7: lighter, two decisions after the last heavier move: the wait stays
    ]


def test_candidates_ranked_by_wire_bytes_per_bucket():
    a = Adaptive(["topk-int8", "none", "int8", "fp16"])
    t = a._track("b", 10_000, 2, "ring")
    assert [a.names[i] for i in t.ladder] == ["none", "fp16", "int8", "topk-int8"]
    # 2 ranks, ring: a rank sends (N - 1) / N of both phases = one chunk each way;
    # none on the backend's allreduce: float32 without payload headers
    assert t.nbytes[0] == 2 * 5000 * 4
    assert t.nbytes[1] == 2 * (5000 * 2 + gc.FP16().wire_nbytes((0,)))
    # the sparse allgather forwards N - 1 payloads (255 x ~310 bytes at 256 ranks with
    # compact indices, vs ~2 x 20000 x 255/256 for fp16): at 256 ranks top-k 1% + int8
    # is no longer lighter on the wire than fp16 for this bucket
    wide = a._track("c", 10_000, 256, "ring")
    assert [a.names[i] for i in wide.ladder][:2] == ["none", "topk-int8"]
    # a bfloat16 bucket's none runs gradcomp's ring: its payloads and headers, not a native kind
    half = a._track("h", 10_000, 2, "ring", torch.bfloat16)
    assert a._natives(t) == [True, False, False, False] and a._natives(half) == [False] * 4
    assert half.nbytes[0] == 2 * gc.NoCompression().wire_nbytes((5000,)) != t.nbytes[0]
    assert a._track("h", 10_000, 2, "ring", torch.bfloat16) is half  # the same bucket
    assert a._track("h", 10_000, 2, "ring").dtype == torch.float32  # a new dtype: a new track


def test_kernel_costs_of_a_large_bucket_are_timed_on_kernel_numel_elements_and_scaled():
    from gradcomp.adaptive import KERNEL_NUMEL

    sizes = []

    class Counting(gc.NoCompression):  # records the size it is timed on
        def compress(self, x):
            sizes.append(x.numel())
            return super().compress(x)

    ticks = iter(range(10**6))
    a = Adaptive([Counting(), "int8"], clock=lambda: next(ticks) * 1e-3)  # every reading 1 ms later
    # each timed run spans two readings: 1 ms, whatever the size
    small = a._kernels(a._track("s", 1000, 2, "ring"), 0, torch.device("cpu"))
    big = a._kernels(a._track("b", 4 * KERNEL_NUMEL, 2, "ring"), 0, torch.device("cpu"))
    assert small == pytest.approx([1e-3, 1e-3])
    assert big == pytest.approx([4e-3, 4e-3])  # scaled from KERNEL_NUMEL elements by size
    assert set(sizes) == {1000, KERNEL_NUMEL}


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(candidates="int8"), TypeError, "candidates must be a sequence"),
    (dict(candidates=[]), ValueError, "candidates must not be empty"),
    (dict(candidates=["int8", "lz4"]), ValueError, "candidates: unknown name 'lz4'"),
    (dict(candidates=["int8", "int8"]), ValueError, "candidates must not repeat"),
    (dict(candidates=[gc.ErrorFeedback(gc.Int8Quantizer())]), ValueError, "must not hold an ErrorFeedback"),
    (dict(candidates=[gc.Threshold(0.1)]), ValueError, "candidates need a fixed wire size"),
    (dict(candidates=[3]), TypeError, "candidates must hold names"),
    (dict(interval=0), ValueError, "interval must be >= 1"),
    (dict(interval=2.5), TypeError, "interval must be an int"),
    (dict(probe=0), ValueError, "probe must be >= 1"),
    (dict(upper=0), ValueError, "upper must be a finite number > 0"),
    (dict(upper="1"), TypeError, "upper must be a real number"),
    (dict(lower=1.0), ValueError, "lower must be > 0 and < upper"),
    (dict(lower=-0.1), ValueError, "lower must be > 0 and < upper"),
    (dict(patience=-1), ValueError, "patience must be >= 0"),
    (dict(memory=None), TypeError, "memory must be an int"),
    (dict(error_feedback=1), TypeError, "error_feedback must be True or False"),
    (dict(clock=5), TypeError, "clock must be a callable"),
    (dict(timing="fast"), TypeError, "timing must be a callable"),
    (dict(convergence=[1.4]), TypeError, "convergence must be a mapping candidate name"),
    (dict(convergence={"lz4": 1.0}), ValueError,
     "convergence: unknown candidate 'lz4'; allowed: ('none', 'fp16', 'int8', 'topk-int8')"),
    (dict(candidates=["none", "int8"], convergence={"topk-int8": 1.4}), ValueError,
     "convergence: unknown candidate 'topk-int8'; allowed: ('none', 'int8')"),
    (dict(convergence={"topk-int8": 0}), ValueError, "convergence['topk-int8'] must be a finite number > 0"),
    (dict(convergence={"topk-int8": -1.5}), ValueError, "convergence['topk-int8'] must be a finite number > 0"),
    (dict(convergence={"int8": float("inf")}), ValueError, "convergence['int8'] must be a finite number > 0"),
    (dict(convergence={"int8": float("nan")}), ValueError, "convergence['int8'] must be a finite number > 0"),
    # factors so large (small) that step time x factor overflows to inf (flushes to 0) made
    # every cost equal and the choice arbitrary
    (dict(convergence={"int8": 1e308}), ValueError, "convergence['int8'] must be a finite number > 0, in [1e-06"),
    (dict(convergence={"int8": 1e-320}), ValueError, "in [1e-06, 1e+06] (steps to a target"),
    (dict(convergence={"int8": "1"}), TypeError, "convergence['int8'] must be a real number, got str"),
    (dict(convergence={"int8": True}), TypeError, "convergence['int8'] must be a real number, got bool"),
])
def test_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        Adaptive(**kwargs)


def test_bad_uses():
    a = Adaptive()
    with pytest.raises(ValueError, match="algorithm must be one of"):
        gc.allreduce(torch.ones(4), a, algorithm="allgather")  # sparse candidates choose it themselves
    with pytest.raises(TypeError, match="compressor must be a gradcomp compressor or 'auto'"):
        GradCompState(compressor="fast")
    with pytest.raises(ValueError, match="algorithm must be one of \\('ring', 'two_phase'\\)"):
        GradCompState(compressor="auto", algorithm="allgather")
    with pytest.raises(TypeError, match="key must be hashable"):
        gc.allreduce(torch.ones(4), a, key=["w"])
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        gc.allreduce(torch.ones(4), a)


def test_meter_switch_log():
    m = gc.TrafficMeter()
    e = {"step": 5, "bucket": 0, "from": "none", "to": "int8", "rho": 2.0}
    m.record_switch(e)
    d = m.as_dict()
    assert d["switches"] == [e] and d["switches"][0] is not e
    other = gc.TrafficMeter()
    other.merge(d)
    other.merge(d)  # every rank logs the same switches: kept once
    other.record_switch({**e, "step": 9})
    assert [s["step"] for s in other.as_dict()["switches"]] == [5, 9]
    other.reset()
    assert other.as_dict()["switches"] == []


def test_meter_merge_of_a_meter_adds_its_counters():
    a, b = gc.TrafficMeter(), gc.TrafficMeter()
    a.record_send(100, 400, phase="reduce_scatter", messages=3)
    a.record_recv(50, phase="allgather")
    a.record_time(0.25, phase="allgather")
    a.record_switch({"step": 1, "to": "int8"})
    a.step()
    b.record_send(7, phase="reduce_scatter")
    b.merge(a)
    b.merge(a)  # counters add twice, the switch is kept once
    d = b.as_dict()
    assert d["phases"]["reduce_scatter"] == {"bytes_sent": 207, "bytes_received": 0, "raw_bytes_sent": 807,
                                             "raw_bytes_received": 0, "messages_sent": 7,
                                             "messages_received": 0, "seconds": 0.0}
    assert d["phases"]["allgather"]["bytes_received"] == 100 and d["phases"]["allgather"]["seconds"] == 0.5
    assert d["steps"] == 1 and d["switches"] == [{"step": 1, "to": "int8"}]
    c = gc.TrafficMeter()
    c.merge(a.as_dict())
    c.merge(a)
    assert c.as_dict()["phases"] == gc.TrafficMeter().as_dict()["phases"] | {
        name: {f: 2 * v for f, v in p.items()} for name, p in a.as_dict()["phases"].items()}


# ---- 2 ranks: the injected link ---------------------------------------------------

INTERVAL = 5
COMPUTE_S = (0.02, 0.01)  # rank 0 computes slower; the agreed compute is rank 1's
SLOW_FROM, FAST_FROM, STEPS = 20, 50, 72
SLOWDOWN = 25
PROBE = 2  # the collective's short windows (the DDP run decides every INTERVAL steps)


#: rank 1's byte-independent cost of top-k + int8 (seconds, 0.02 x the agreed compute);
#: rank 0's and every other codec's are 0: the ranks must agree on the MAX
TOPK_KERNEL_S = 0.0002
#: rank 1's wait for rank 0 in each collective (rank 0 computes slower and arrives later)
WAIT_S = COMPUTE_S[0] - COMPUTE_S[1]


def _link(rank, steady=None, kernels=None):
    """The injected link of ``rank``: for each bucket (or key), fast enough that
    uncompressed traffic takes 0.4 x the agreed compute; it slows down 25x for
    steps [SLOW_FROM, FAST_FROM), except for bucket ``steady``. A codec's
    kernel cost (rank 1's: ``TOPK_KERNEL_S`` for top-k + int8 when ``kernels``
    is a list, 0 otherwise) replaces the kernel timings and is added to each
    collective's time on both ranks (the collective waits for the slowest
    rank's compression); rank 1 also waits ``WAIT_S`` for rank 0 in each
    collective; ``kernels`` collects the kernel timings the hook saw."""
    def timing(s: Timing) -> Timing:
        kernel = TOPK_KERNEL_S if kernels is not None and s.codec == "topk-int8" else 0.0
        if s.kind == "kernel":
            if kernels is not None:
                kernels.append(s)
            return dataclasses.replace(s, comm_s=kernel if rank == 1 else 0.0)
        rate = 4 * s.numel / (0.4 * COMPUTE_S[1])  # bytes per second
        if SLOW_FROM <= s.step < FAST_FROM and s.bucket != steady:
            rate /= SLOWDOWN
        wait = WAIT_S if rank == 1 else 0.0
        return dataclasses.replace(s, comm_s=kernel + s.wire_bytes / rate + wait,
                                   compute_s=COMPUTE_S[rank] if s.compute_s is not None else None)
    return timing


TOPK_FACTOR = 1.2  # top-k's convergence factor in the DDP test


def _expected(interval):
    """Switches derived by hand for a link where uncompressed traffic takes
    0.4 x the compute C when fast and 10 x when slow (25x slower), for
    ``none`` ~ 4 bytes/element, fp16 ~ 2, int8 ~ 1, top-k 1% + int8 ~ 0.09
    (141 bytes for 1667 elements; 0.02 C more with its kernel cost); top-k's
    convergence factor 1.2 (TOPK_FACTOR), the others' 1; the agreed wait
    WAIT_S = C (costs in units of C: the step 1 + 1 + max(0, T - 1) x the factor):

    Decisions come at steps 1 + k x interval (step 0 has no compute time, so no
    measurement; a window is ``interval`` measured steps), and ``interval``
    steps after a switch (the DDP run's probe):

    * decision at step SLOW_FROM + interval + 1 (the first window of slow steps):
      none's T = 10 (one codec measured: all per byte): fp16 (5.1) and int8
      (2.7) cost 1 + their T, top-k (0.02 + 10 x 0.021, hidden) costs 2 x 1.2 =
      2.4: int8 (3.7 <= 2 x 2.4, converges faster, not measured) is measured on
      the way: none -> int8.
    * the next decision: int8 measured at 2.7 (cost 3.7 > 1.1 x 2.4): int8 ->
      topk-int8.
    * while slow, on top-k (T ~ 0.23): none (10) and int8 (2.7) measured and
      costlier: stay.
    * first window of fast steps (decision at FAST_FROM + interval + 1): top-k's
      T falls to ~ 0.03, 8x less: the link changed, the other measurements are
      forgotten; none is predicted from top-k alone, 2 x ~0.43 (its bytes at
      top-k's seconds per byte), hidden: cost 2 < 2.4: topk-int8 -> none
      (the hold after the heavier move ran out long before). Then none stays
      (0.4, hidden; nothing costs less).
    """
    slow, fast = SLOW_FROM + interval + 1, FAST_FROM + interval + 1
    return [(slow, "none", "int8"), (slow + interval, "int8", "topk-int8"), (fast, "topk-int8", "none")]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 32), nn.Tanh(), nn.Linear(32, 3))

    def forward(self, x):
        return self.body(x)


def _data(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)


def _gathered(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _ddp_run(rank):
    """DDP with compressor="auto" on the injected link, two buckets after DDP's
    rebuild (1667 and 624 elements; bucket 1's link never slows); records each
    step's bucket input, residual before the step and output."""
    torch.manual_seed(0)
    model = DDP(_Net(), bucket_cap_mb=0.004)
    meter = gc.TrafficMeter()
    kernels = []
    # top-k's factor 1.2: int8 (3.7 C) is within 2 x top-k's cost (2.4 C) and is measured on
    # the way, then top-k
    policy = Adaptive(interval=INTERVAL, probe=INTERVAL, convergence={"topk-int8": TOPK_FACTOR},
                      timing=_link(rank, steady=1, kernels=kernels))
    state = GradCompState(compressor=policy, min_compress_numel=0, start_iter=0, meter=meter, timeout=30)
    records = {}

    def hook(st, bucket):
        step = st.iter
        keys = [st._key(p) for p in bucket.parameters()]
        res = [st.residuals.get(k) for k in keys]
        before = (bucket.buffer().clone(),
                  torch.cat([r.clone() if r is not None else torch.zeros(p.numel())
                             for r, p in zip(res, bucket.parameters())]))

        def done(f, index=bucket.index()):
            records[step, index] = (*before, f.value().clone())
            return f.value()
        return compressed_allreduce_hook(st, bucket).then(done)

    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    codecs, identical = [], True
    for step in range(STEPS):
        x, y = _data(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        codecs.append((policy.codec(0), policy.codec(1)))
        p = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
        ps = _gathered(p)
        identical &= all(torch.equal(ps[0], q) for q in ps)
    # the switch out of top-k: this step's codec (none) must deliver the residual top-k left
    at = _expected(INTERVAL)[-1][0]
    g, r, out = records[at, 0]
    everyone = [_gathered(t) for t in (g, r)]
    restored = pickle.loads(pickle.dumps(state))
    state.close()
    return {"switches": meter.as_dict()["switches"], "policy_switches": policy.switches, "codecs": codecs,
            "identical": identical, "out": out, "g": everyone[0], "r": everyone[1],
            "restored_codec": restored.adaptive.codec(0), "restored_switches": len(restored.adaptive.switches),
            "numels": (policy._tracks[0].numel, policy._tracks[1].numel),
            "kernels": [(k.bucket, k.codec, k.numel, k.wire_bytes, k.comm_s, k.step) for k in kernels]}


def _collective_run(rank):
    """gc.allreduce(t, Adaptive(...), key=...) on the injected link, over two
    keys; candidates none and int8 only, so the switch back to none delivers
    the int8 residual exactly."""
    n = 3000
    policy = Adaptive(["int8", "none"], interval=INTERVAL, probe=PROBE, timing=_link(rank))
    meter = gc.TrafficMeter()
    codecs, identical, carried = [], True, None
    for step in range(STEPS):
        g = torch.Generator().manual_seed(7 * step + rank)
        t = torch.randn(n, generator=g) * (1 + rank)
        before = policy.residuals.get("w")
        before = before.clone() if before is not None else torch.zeros(n)
        switched = len(policy.switches)
        out = gc.allreduce(t, policy, key="w", meter=meter)
        if carried is None and any(s["to"] == "none" for s in policy.switches[switched:]):
            # this call was the first with none: it delivered input + residual exactly
            carried = (_gathered(t), _gathered(before), out.clone(), policy.residuals["w"].clone())
        gc.allreduce(torch.full((5,), float(step)), policy, key="small")  # a second key, same policy
        outs = _gathered(out)
        identical &= all(torch.equal(outs[0], o) for o in outs)
        codecs.append(policy.codec("w"))
    bad = Adaptive(timing=lambda s: None)
    try:
        gc.allreduce(torch.ones(8), bad)
        bad_timing = None
    except TypeError as e:
        bad_timing = str(e)
    return {"switches": [s for s in policy.switches if s["bucket"] == "w"], "meter": meter.as_dict()["switches"],
            "identical": identical, "carried": carried, "codecs": codecs, "bad_timing": bad_timing}


#: the prior of the start tests: 0.1 ms per message, 1e5 bytes/s (10 us a byte)
PRIOR = (1e-4, 1e5)


def _prior_timing(rank, slow_int8_kernel, timed=None):
    """Kernel timings of 0, except rank 1's int8 on the keys of ``slow_int8_kernel``
    (5 s); ``timed`` collects the (key, codec) of every kernel timing."""
    def timing(s: Timing) -> Timing:
        if s.kind != "kernel":
            return s
        if timed is not None:
            timed.append((s.bucket, s.codec))
        slow = rank == 1 and s.codec == "int8" and s.bucket in slow_int8_kernel
        return dataclasses.replace(s, comm_s=5.0 if slow else 0.0)
    return timing


def _prior_run(rank):
    """The start under a link prior, in the collective and in DDP.

    Collective, candidates none / int8 / top-k + int8 (2 ranks; none sends ~4
    bytes an element, int8 ~1): under PRIOR, on 3000 elements none takes ~1.2
    s, int8 ~0.3 s, top-k converges slower (no start). Key "a" (3000): int8.
    Key "b" (7000, more than 2x "a": timed): rank 1 times int8's kernel at 5 s,
    and the agreed (MAX) 5.7 s is more than none's 2.8: none. Key "c" (3000):
    reuses "a"'s kernel costs (rank 1 would time int8 at 5 s): int8.
    DDP, one bucket of _Net's 2243 parameters: int8 from step 0.
    """
    timed = []
    policy = Adaptive(["none", "int8", "topk-int8"], link=PRIOR, timing=_prior_timing(rank, {"b", "c"}, timed))
    meter = gc.TrafficMeter()
    outs = {}
    for key, n in (("a", 3000), ("b", 7000), ("c", 3000)):
        t = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * (1 + rank)
        outs[key] = _gathered(gc.allreduce(t, policy, key=key, meter=meter))
    torch.manual_seed(0)
    model = DDP(_Net())
    ddp_policy = Adaptive(link=PRIOR, timing=_prior_timing(rank, set()))
    state = GradCompState(compressor=ddp_policy, min_compress_numel=0, start_iter=0, timeout=30)
    model.register_comm_hook(state, compressed_allreduce_hook)
    x, y = _data(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    grads = _gathered(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    state.close()
    return {"codecs": (policy.codec("a"), policy.codec("b"), policy.codec("c")), "timed": timed,
            "switches": policy.switches,
            "meter": meter.as_dict()["switches"], "identical": all(torch.equal(o[0], o[1]) for o in outs.values()),
            "ddp_codec": ddp_policy.codec(0), "ddp_switches": ddp_policy.switches,
            "ddp_identical": torch.equal(grads[0], grads[1])}


def _after_start_timing(s: Timing) -> Timing:
    """Kernels 0; int8 (gradcomp's ring) measures 1.5x what the prior predicts
    for none; none (the backend's allreduce) what the prior predicts; 10 ms of compute."""
    if s.kind == "kernel":
        return dataclasses.replace(s, comm_s=0.0)
    none_prior = 2 * PRIOR[0] + 4 * s.numel / PRIOR[1]  # 2 ranks: 2 messages, 4 bytes an element
    comm = 1.5 * none_prior if s.codec == "int8" else 2 * PRIOR[0] + s.wire_bytes / PRIOR[1]
    return dataclasses.replace(s, comm_s=comm, compute_s=0.01 if s.compute_s is not None else None)


def _after_start_run(rank):
    """Candidates none / int8 under PRIOR, 3000 elements, probe 2: the start
    takes int8 (the prior: ~4x faster than none); int8 then measures 1.5x
    none's prediction, which with the lighter-move caution (2x) would keep
    int8, but the first decision after the start predicts none from the
    prior as it is: none at call 3 (samples of calls 1-2). Then none, measured
    as predicted, stays."""
    policy = Adaptive(["none", "int8"], link=PRIOR, probe=2, interval=5, timing=_after_start_timing)
    flags = []
    for call in range(8):
        t = torch.randn(3000, generator=torch.Generator().manual_seed(10 * call + rank))
        gc.allreduce(t, policy, key="d")
        flags.append(policy._tracks["d"].from_start)
        if call == 0:
            restored = pickle.loads(pickle.dumps(policy))._tracks["d"].from_start
    return {"switches": policy.switches, "flags": flags, "restored": restored, "codec": policy.codec("d")}


def _cleared_run(rank):
    """``none`` (the backend's allreduce) with a residual, 2 ranks: x = rank's
    (rank + 1) x [0..5], the residual (rank + 1) everywhere."""
    policy = Adaptive(["none"])
    x = torch.arange(6.0) * (rank + 1)
    r = torch.full((6,), float(rank + 1))
    outs = [gc.allreduce(x, policy, key="k", residual=r)]  # delivers it, zeroes it
    zeroed = torch.equal(r, torch.zeros(6))
    outs.append(gc.allreduce(x, policy, key="k", residual=r))  # known zero: skipped
    r[2:3].add_(10.0 * (rank + 1))  # an in-place write through a view: delivered next
    outs.append(gc.allreduce(x, policy, key="k", residual=r))
    outs.append(gc.allreduce(x, policy, key="k", residual=torch.ones(6)))  # another tensor
    return {"outs": outs, "zeroed": zeroed, "residual": r}


def _both(rank, world):
    return {"ddp": _ddp_run(rank), "collective": _collective_run(rank), "prior": _prior_run(rank),
            "cleared": _cleared_run(rank), "after_start": _after_start_run(rank)}


@pytest.fixture(scope="module")
def runs():
    return launch(_both, 2, timeout=TIMEOUT)


@pytest.mark.slow
def test_ddp_auto_switches_with_the_link_and_ranks_agree(runs):
    got = [[(s["step"], s["bucket"], s["from"], s["to"]) for s in r["ddp"]["switches"]] for r in runs]
    # bucket 1's link stays fast: it keeps "none"; bucket 0 follows the link
    assert got[0] == got[1] == [(step, 0, a, b) for step, a, b in _expected(INTERVAL)]
    assert runs[0]["ddp"]["numels"] == (1667, 624)
    assert {c[1] for c in runs[0]["ddp"]["codecs"][1:]} == {"none"}
    assert runs[0]["ddp"]["switches"] == runs[1]["ddp"]["switches"]  # the agreed numbers too
    assert runs[0]["ddp"]["policy_switches"] == runs[0]["ddp"]["switches"]
    assert runs[0]["ddp"]["codecs"] == runs[1]["ddp"]["codecs"]
    assert all(r["ddp"]["identical"] for r in runs)
    first, to_topk, back = runs[0]["ddp"]["switches"]
    # agreed: rank 0's slow link (10 x the compute, no wait) over rank 1's compute
    assert first["compute_s"] == COMPUTE_S[1]
    assert first["rho"] == pytest.approx(10.0, rel=0.02)
    assert first["wait_s"] == pytest.approx(WAIT_S)
    # the predictions behind the first switch, re-derived from the wire bytes: the
    # slow link sends 4 x 1667 bytes in 10 x C; top-k's kernel cost is rank 1's (the MAX)
    c = COMPUTE_S[1]
    per_byte_slow = 10 * c / (4 * 1667)
    assert first["latency_s"] == 0 and first["s_per_byte"] == pytest.approx(per_byte_slow)
    p = first["predicted"]
    assert list(p) == ["none", "fp16", "int8", "topk-int8"]
    assert [p[n]["kernel_s"] for n in p] == [0, 0, 0, TOPK_KERNEL_S]
    assert [p[n]["convergence"] for n in p] == [1, 1, 1, TOPK_FACTOR]
    assert p["none"]["comm_s"] == first["comm_s"] == pytest.approx(p["none"]["wire_bytes"] * per_byte_slow)
    assert p["int8"]["comm_s"] == pytest.approx(p["int8"]["wire_bytes"] * per_byte_slow)
    # exposed beyond C: C + W + (T - C)
    assert p["int8"]["step_s"] == pytest.approx(p["int8"]["comm_s"] + WAIT_S)
    topk = TOPK_KERNEL_S + p["topk-int8"]["wire_bytes"] * per_byte_slow
    assert p["topk-int8"]["comm_s"] == pytest.approx(topk) and topk < c
    assert p["topk-int8"]["cost_s"] == pytest.approx(TOPK_FACTOR * (c + WAIT_S))  # hidden: C + W
    # the next decision: int8 measured as predicted, top-k unchanged
    assert to_topk["comm_s"] == pytest.approx(p["int8"]["comm_s"])
    assert to_topk["predicted"]["topk-int8"]["cost_s"] == pytest.approx(p["topk-int8"]["cost_s"])
    # back on the fast link: none predicted from top-k's seconds per byte, twice its link
    # time (top-k's bytes sent vary with the compact indices: near the ladder's estimate)
    q = back["predicted"]
    fast = (back["comm_s"] - TOPK_KERNEL_S) / q["topk-int8"]["wire_bytes"]
    assert fast == pytest.approx(per_byte_slow / SLOWDOWN, rel=0.1)
    assert back["latency_s"] == 0 and back["s_per_byte"] == pytest.approx(fast)
    assert q["none"]["comm_s"] == pytest.approx(2 * q["none"]["wire_bytes"] * fast)
    assert q["none"]["cost_s"] == pytest.approx(c + WAIT_S)
    assert runs[0]["ddp"]["restored_codec"] == "none" and runs[0]["ddp"]["restored_switches"] == 3


@pytest.mark.slow
def test_a_delivered_residual_is_skipped_until_written(runs):
    """The average of x (0..5 x 1 and x 2: 1.5 x [0..5]) plus the residuals'
    average where one is due: 1.5 everywhere first; nothing once delivered;
    (10 + 20) / 2 at index 2 after the in-place write; 1 for a new tensor."""
    base = 1.5 * torch.arange(6.0)
    bump = torch.zeros(6)
    bump[2] = 15.0
    for r in runs:
        c = r["cleared"]
        assert c["zeroed"] and torch.equal(c["residual"], torch.zeros(6))
        for got, want in zip(c["outs"], (base + 1.5, base, base + bump, base + 1.0)):
            assert torch.equal(got, want)


@pytest.mark.slow
def test_ddp_kernel_costs_are_timed_once_per_bucket(runs):
    """Every rank times each compressing candidate's compress + decompress once
    per bucket, on the bucket's size, at the bucket's first decision that could
    move it: bucket 0 at the first window of the slow link (its first switch),
    bucket 1, whose link stays fast, never (on none, hidden, nothing heavier
    could pay whatever its kernels cost); none (the backend's allreduce) runs
    no kernel."""
    for r in runs:
        k = r["ddp"]["kernels"]
        assert sorted((b, codec, n) for b, codec, n, _, _, _ in k) == [
            (0, codec, 1667) for codec in ("fp16", "int8", "topk-int8")]
        assert all(wire == 0 and 0 < secs < 1 for _, _, _, wire, secs, _ in k)
        first_switch = r["ddp"]["switches"][0]["step"]
        assert first_switch == SLOW_FROM + INTERVAL + 1 and {step for *_, step in k} == {first_switch}


@pytest.mark.slow
def test_ddp_residuals_carry_over_a_switch(runs):
    """At the step that switches from top-k to none, the averaged gradient is
    the mean of (gradient + residual top-k left), exactly up to float32 sums."""
    d = runs[0]["ddp"]
    g = torch.stack(d["g"]).double()
    r = torch.stack(d["r"]).double()
    expected = (g + r).mean(0)
    err = (d["out"].double() - expected).abs().max()
    assert err <= 1e-6 * (g + r).abs().max()
    assert r.mean(0).abs().max() > 1e-3 * (g + r).abs().max()  # without the residual the test would fail
    assert torch.equal(runs[0]["ddp"]["out"], runs[1]["ddp"]["out"])


@pytest.mark.slow
def test_collective_auto_switches_and_delivers_residuals(runs):
    got = [[(s["step"], s["from"], s["to"]) for s in r["collective"]["switches"]] for r in runs]
    # Steps count the key's calls; call 0 has no compute time (no sample). With
    # probe 2 and interval 5, decisions come at calls 3 (samples of calls 1-2,
    # the first probe), 8, 13, 18, 23: the window 18-22 has 3 slow calls of 5, so
    # its median is slow: rho(none) = 10 -> int8 (the only heavier one). The
    # probe after the switch decides at 25 (int8 ~ 2.5: nothing better), then
    # 30, ..., 50 (slow: stay) and 55: window 50-54 fast, rho(int8) ~ 0.1, none
    # predicted ~ 0.4 <= 0.5, and the hold (patience 2) has run out -> none.
    assert got[0] == got[1] == [(23, "none", "int8"), (55, "int8", "none")]
    assert runs[0]["collective"]["meter"] == runs[1]["collective"]["meter"]
    assert all(r["collective"]["identical"] for r in runs)
    ts, rs, out, after = runs[0]["collective"]["carried"]
    exact = (torch.stack(ts).double() + torch.stack(rs).double()).mean(0)
    assert torch.allclose(out.double(), exact, rtol=0, atol=1e-6)
    assert torch.stack(rs).double().mean(0).abs().max() > 1e-3  # int8 left something to deliver
    assert torch.count_nonzero(after) == 0  # delivered in full


@pytest.mark.slow
def test_timing_hook_must_return_a_timing(runs):
    assert all("timing must return a gradcomp.adaptive.Timing, got NoneType" in r["collective"]["bad_timing"]
               for r in runs)


@pytest.mark.slow
def test_link_prior_starts_on_the_predicted_codec_and_ranks_agree(runs):
    for r in runs:
        p = r["prior"]
        assert p["codecs"] == ("int8", "none", "int8")  # "b": rank 1's slow int8 kernel counts for both
        assert [(s["step"], s["bucket"], s["from"], s["to"], s["start"]) for s in p["switches"]] == [
            (0, "a", "none", "int8", True), (0, "c", "none", "int8", True)]
        # none (the backend's allreduce) runs no kernel; "c" reuses "a"'s costs
        assert sorted(p["timed"]) == sorted((k, c) for k in "ab" for c in ("int8", "topk-int8"))
        a, c = p["switches"][0]["predicted"], p["switches"][1]["predicted"]
        assert [c[n]["kernel_s"] for n in a] == [a[n]["kernel_s"] for n in a]  # same size: the same
        s = p["switches"][0]
        assert s["prior_latency_s"] == PRIOR[0] and s["prior_bytes_per_s"] == PRIOR[1]
        assert s["predicted"]["none"]["comm_s"] == pytest.approx(
            2 * PRIOR[0] + s["predicted"]["none"]["wire_bytes"] / PRIOR[1])
        assert p["meter"] == p["switches"] and p["identical"]
        assert p["ddp_codec"] == "int8" and p["ddp_identical"]
        assert [(s["step"], s["to"], s["start"]) for s in p["ddp_switches"]] == [(0, "int8", True)]
    assert runs[0]["prior"]["switches"] == runs[1]["prior"]["switches"]


@pytest.mark.slow
def test_the_first_decision_after_a_start_measures_none_against_the_prior(runs):
    assert runs[0]["after_start"]["switches"] == runs[1]["after_start"]["switches"]
    for r in runs:
        a = r["after_start"]
        assert [(s["step"], s["from"], s["to"], s.get("start", False)) for s in a["switches"]] == [
            (0, "none", "int8", True), (3, "int8", "none", False)]
        assert a["codec"] == "none" and a["restored"] is True
        assert a["flags"] == [True, True, True] + [False] * 5  # cleared by the first decision
        first = a["switches"][1]
        none_prior = 2 * PRIOR[0] + first["predicted"]["none"]["wire_bytes"] / PRIOR[1]
        assert first["predicted"]["none"]["comm_s"] == pytest.approx(none_prior)  # no 2x caution
        assert first["comm_s"] == first["exposed_s"] == pytest.approx(1.5 * (2 * PRIOR[0] + 4 * 3000 / PRIOR[1]))
        assert first["wait_s"] == 0.0 and first["compute_s"] == 0.01
