"""gc.LocalSGD(partial_work=True): a slow rank runs fewer inner steps of a round (gradcomp.partial_work).

The seconds of each inner step come from an injected clock (no sleeps), powers of two so that
every median and quotient is exact. Hand derivation for the 3-rank launch (``H = 8``, rank 1
three times slower, 3/64 s a step against 1/64 s, until step 40): the ranks agree at the first
synchronisation (step 8) and then at the first one at least 16 steps later (24, 40, 56, 72, 88);
each rank's figure is the median of its latest 8 computed steps. At step 8 rank 1 is 3x the
ranks' lower median (1/64 s; beyond 1.5 times it): the round's budget is ``8 x 1/64``, its
quota ``floor(8 / 3) = 2``. It computes 2 steps a round (steps 9-10, 17-18, ...), so from step
41 on (compute 1/64 s) the window holds four slow and four fast steps at the agreement of step
56: median 2/64 s, still beyond 1.5/64, quota ``8 / 2 = 4``; at step 72 eight fast steps: quota
8 again. The other ranks run every step throughout. Each round of
uneven steps averages the ranks' models weighted by their steps.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import gradcomp as gc
from gradcomp.launch import launch
from gradcomp.partial_work import AGREE_EVERY, TOLERANCE, WINDOW, PartialWork, least_period, quotas

WORLD = 3
TIMEOUT = 60
H = 8
STEPS = 88
FAST, SLOW = 1 / 64, 3 / 64
#: the tolerance the hand derivations use (the default, TOLERANCE, is tested on its own below)
HAND = 1.5


class _Clock:
    """Seconds that move only when the test says so."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 30), nn.Tanh(), nn.Linear(30, 3))


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _run(rank, world_size):
    clock = _Clock()
    model = _model()
    meter = gc.TrafficMeter()
    ls = gc.LocalSGD(model, H, compressor=gc.NoCompression(), meter=meter, timeout=TIMEOUT,
                     partial_work=PartialWork(HAND, clock=clock))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    computed, rounds, identical, mean_ok = 0, [], [], []
    for t in range(1, STEPS + 1):
        if ls.should_compute:
            g = torch.Generator().manual_seed(1000 * rank + t)
            x, y = torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            computed += 1
            clock.t += SLOW if rank == 1 and t <= 40 else FAST
        if t % H == 0:  # the parameters before the exchange and the steps each rank ran
            local = _flat(model)
            gathered = [torch.empty_like(local) for _ in range(WORLD)]
            dist.all_gather(gathered, local)
            ran = [torch.zeros(1) for _ in range(WORLD)]
            dist.all_gather(ran, torch.tensor([float(computed)]))
        ls.step()
        if t % H == 0:
            rounds.append(computed)
            computed = 0
            after = _flat(model)
            out = [torch.empty_like(after) for _ in range(WORLD)]
            dist.all_gather(out, after)
            identical.append(all(torch.equal(after, o) for o in out))
            # the step-weighted mean of the ranks' models: sum_i steps_i x params_i / sum_i steps_i
            weights = torch.cat(ran)
            expected = (torch.stack(gathered) * weights[:, None]).sum(0) / weights.sum()
            mean_ok.append(torch.allclose(after, expected, rtol=0, atol=1e-6))
    ls.close()
    return {"rounds": rounds, "identical": identical, "mean_ok": mean_ok,
            "logged": [e for e in meter.switches if e.get("kind") == "partial_work"]}


@pytest.fixture(scope="module")
def runs():
    return launch(_run, world_size=WORLD, timeout=120)


def test_the_slow_rank_runs_its_hand_derived_share_of_each_round(runs):
    # rounds end at steps 8, 16, ..., 88: the quota agreed at step s applies from step s + 1
    assert runs[1]["rounds"] == [8, 2, 2, 2, 2, 2, 2, 4, 4, 8, 8]
    assert runs[0]["rounds"] == runs[2]["rounds"] == [8] * (STEPS // H)


def test_the_ranks_stay_bit_identical_and_average_their_models_weighted_by_steps(runs):
    for r in runs:
        assert all(r["identical"]) and all(r["mean_ok"])


def test_every_rank_logs_the_same_cuts_and_their_end(runs):
    logged = runs[0]["logged"]
    assert [(e["step"], e["quotas"]) for e in logged] == [(8, [8, 2, 8]), (56, [8, 4, 8]), (72, [8, 8, 8])]
    assert logged[0]["compute_s"] == [FAST, SLOW, FAST]
    assert runs[1]["logged"] == runs[2]["logged"] == logged


@pytest.mark.parametrize("compute, period, expected", [
    ([0.01, 0.01, 0.01], 16, [16, 16, 16]),            # equal: nobody is cut
    ([0.016, 0.01, 0.017, 0.018], 16, [16] * 4),      # within 1.5 x the lower median (0.016): one fast rank cuts nobody
    ([0.02, 0.01, 0.011, 0.012], 16, [9, 16, 16, 16]),  # 0.02 > 1.5 x 0.011: floor(16 x 0.012 / 0.02)
    ([0.01, 0.0149, 0.0151], 8, [8, 8, 8]),            # bound 1.5 x 0.0149: nobody is cut
    ([0.01, 0.016, 0.01], 8, [8, 5, 8]),               # 0.016 > 0.015: floor(8 x 0.01 / 0.016)
    ([0.01, 0.0124, 0.01], 16, [16, 16, 16]),          # within the tolerance
    ([0.01, 0.03, 0.01, 0.012], 64, [64, 25, 64, 64]),  # budget 64 x 0.012 s: floor(0.768 / 0.03)
    ([0.01, 0.05], 4, [4, 1]),                         # of two, the faster is the reference; at least one step
    ([0.01, float("nan"), 0.04], 8, [8, 8, 2]),        # not measured: runs all
    ([float("nan")] * 2, 8, [8, 8]),
])
def test_quotas_by_hand(compute, period, expected):
    assert quotas(compute, period, HAND) == expected


def test_the_defaults():
    assert TOLERANCE > 1 and WINDOW >= 1 and AGREE_EVERY >= 1


def test_the_default_tolerance_keeps_a_rank_twice_as_slow():
    # ranks that share a host's cores measure up to about 2x apart: not cut; beyond 2x, cut
    assert quotas([0.01, 0.02, 0.01], 8) == [8, 8, 8]
    assert quotas([0.01, 0.021, 0.01], 8) == [8, 3, 8]  # floor(8 x 0.01 / 0.021)


@pytest.mark.parametrize("kwargs, error, name", [
    ({"partial_work": "yes"}, TypeError, "partial_work"),
    ({"partial_work": True, "fragments": 2, "sync_every": 4}, ValueError, "fragments"),
    ({"partial_work": True, "overlap": 1, "sync_every": 4}, ValueError, "overlap"),
])
def test_bad_arguments_raise_naming_them(kwargs, error, name):
    from gradcomp.partial_work import partial_work_argument
    with pytest.raises(error, match=name):
        partial_work_argument(kwargs["partial_work"], kwargs.get("fragments", 1), kwargs.get("overlap", 0))


@pytest.mark.parametrize("tolerance, error", [(1.0, ValueError), (0.5, ValueError), (float("inf"), ValueError),
                                              ("2", TypeError), (True, TypeError)])
def test_bad_tolerance(tolerance, error):
    with pytest.raises(error, match="tolerance"):
        PartialWork(tolerance)


def test_before_an_agreement_a_rank_runs_every_step():
    work = PartialWork()
    for _ in range(20):
        assert work.should_compute and work.steps_run() is None
        work.stepped()
        work.returned()


def test_weigh_by_hand():
    work = PartialWork()
    work.quotas, work._rank, work.done = [8, 2, 8], 1, 8  # a round of 8: rank 1 ran 2 steps
    delta = torch.ones(4)
    assert work.weigh_(delta) and torch.equal(delta, torch.full((4,), 3 * 2 / 18))
    work._rank, work._exchanged = 0, 0
    delta = torch.ones(4)
    assert work.weigh_(delta) and torch.equal(delta, torch.full((4,), 3 * 8 / 18))
    work.done, work._exchanged = 2, 0  # a synchronisation after two steps of the round: every rank ran 2
    delta = torch.ones(4)
    assert not work.weigh_(delta) and torch.equal(delta, torch.ones(4))
    # sync() in the middle of a round (after step 4), then the round's end: the steps since that exchange
    work.done, work._exchanged = 4, 0
    assert work.steps_run() == [4, 2, 4]
    work.weigh_(torch.ones(4))
    work.done = 8
    assert work.steps_run() == [4, 0, 4]
    delta = torch.ones(4)
    assert work.weigh_(delta) and torch.equal(delta, torch.full((4,), 3 * 4 / 8))


def test_reset_forgets_the_round_and_the_measurements():
    work = PartialWork()
    work.quota, work.quotas, work.compute_s, work.agreed_at, work.done = 2, [8, 2], [0.1, 0.3], 40, 5
    work.reset()
    assert work.should_compute and work.steps_run() is None and work.agreed_at is None and work.done == 0


@pytest.mark.parametrize("clock", [None, 5, "x"])
def test_bad_clock(clock):
    with pytest.raises(TypeError, match="clock"):
        PartialWork(clock=clock)


def test_least_period_by_hand():
    assert least_period([0.01, 0.01, 0.01]) == 1                 # nobody beyond the tolerance
    assert least_period([0.01, 0.03, 0.01]) == 3                 # 0.03 / 0.01
    assert least_period([0.01, 0.035, 0.012, 0.01]) == 3         # ceil(0.035 / 0.012)
    assert least_period([0.01, float("nan"), 0.05]) == 5


def _raise(rank, world_size):
    """Rank 1 three times slower (2 ranks: lower median 1/64 s, bound 1.5/64): its one step needs a
    round of 3 of rank 0's steps; an adaptive period of 2 is raised to 3 (not past ``most``)."""
    out = []
    for most in (8, 2, None):
        clock, meter = _Clock(), gc.TrafficMeter()
        work = PartialWork(HAND, clock=clock)
        for _ in range(5):
            work.stepped()
            work.returned()
            clock.t += SLOW if rank == 1 else FAST
        work.stepped()
        period = work.new_round(6, 2, dist.group.WORLD, TIMEOUT, torch.device("cpu"), meter, most)
        out.append((period, work.quotas, [(e["sync_every"], e["raised_from"]) for e in meter.switches]))
    return out


def test_an_adaptive_period_is_raised_to_fit_the_slow_ranks_step():
    got = launch(_raise, world_size=2, timeout=60)
    assert got[0] == got[1] == [(3, [3, 1], [(3, 2)]), (2, [2, 1], [(2, None)]), (2, [2, 1], [(2, None)])]


def _restore(rank, world_size):
    """Rank 1 slow and cut to 2 of 8 steps; the checkpoint of step 16 restored after step 20
    (mid-round) rewinds the step count to 16 and resets the cut: every rank computes every step
    until the next agreement (the restored run's first synchronisation, its step 24, the loop's
    28), then rank 1 is cut again."""
    clock = _Clock()
    model = _model()
    ls = gc.LocalSGD(model, H, compressor=gc.NoCompression(), timeout=TIMEOUT, partial_work=PartialWork(HAND, clock=clock))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    computes, saved = [], None
    for t in range(1, 41):
        computes.append(ls.should_compute)
        if ls.should_compute:
            g = torch.Generator().manual_seed(1000 * rank + t)
            nn.functional.cross_entropy(model(torch.randn(8, 10, generator=g)),
                                        torch.randint(0, 3, (8,), generator=g)).backward()
            opt.step()
            opt.zero_grad()
            clock.t += SLOW if rank == 1 else FAST
        ls.step()
        if t == 16:
            saved = ls.state_dict()
        if t == 20:
            ls.load_state_dict(saved)
    ls.close()
    return computes


def test_a_restored_checkpoint_measures_again():
    got = launch(_restore, world_size=3, timeout=60)
    assert all(got[0]) and all(got[2])
    # rank 1 (loop steps): cut after the agreement of step 8 (11-16 and 19-20 idle), every step
    # after the restore (21-28), cut again from the agreement at the loop's step 28 (31-36, 39-40 idle)
    idle = [t for t, c in enumerate(got[1], 1) if not c]
    assert idle == [*range(11, 17), 19, 20, *range(31, 37), 39, 40]
