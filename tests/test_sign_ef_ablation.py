"""benchmarks/sign_ef_ablation.py's aggregations against gradcomp's own collectives.

The ablation replays the DDP hook's ring and two-phase allreduce in one process; its findings
hold only if those replays are the collectives: the same averages and the same residuals, step
after step, as ``gc.allreduce`` with a flat residual (the DDP hook's) on four ranks.
"""

import argparse
import importlib.util
import pathlib

import pytest
import torch

import gradcomp as gc
from gradcomp.comm import chunk_bounds
from gradcomp.launch import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORLD, N, BLOCK, STEPS = 4, 4 * 96 + 3, 32, 3  # chunks of 97 and 96: blocks cut by the chunks


def _inputs(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(N, generator=g) for _ in range(WORLD)]


def _collective(rank, world, algorithm, server_ef):
    residual = torch.zeros(N)
    out = []
    for step in range(STEPS):
        avg = gc.allreduce(_inputs(step)[rank], gc.SignQuantizer(block_size=BLOCK), algorithm=algorithm,
                           residual=residual, server_error_feedback=server_ef)
        out.append((avg, residual.clone()))
    return out


def _replay(algorithm, server_ef):
    spec = importlib.util.spec_from_file_location("sign_ef_ablation", ROOT / "benchmarks" / "sign_ef_ablation.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    a = argparse.Namespace(agg=algorithm, keep_zeros=False, server_ef=server_ef)
    sign = gc.SignQuantizer(block_size=BLOCK)
    codec = lambda x, pieces: sign.decompress(sign.compress(x))  # noqa: E731
    res = [torch.zeros(N) for _ in range(WORLD)]
    out = []
    for step in range(STEPS):
        g = _inputs(step)
        avg = torch.empty(N)
        for j, (lo, hi) in enumerate(chunk_bounds(N, WORLD)):
            avg[lo:hi] = bench.aggregate(a, codec, [x[lo:hi] for x in g], [e[lo:hi] for e in res], [], j)
        out.append((avg, [e.clone() for e in res]))
    return out


@pytest.mark.parametrize("algorithm,server_ef", [("ring", False), ("two_phase", False), ("two_phase", True)])
def test_the_replay_is_the_collective(algorithm, server_ef):
    ranks = launch(_collective, WORLD, (algorithm, server_ef), timeout=120)
    replay = _replay(algorithm, server_ef)
    for step, (avg, residuals) in enumerate(replay):
        for rank in range(WORLD):
            got, residual = ranks[rank][step]
            # float32 sums added in another order: equal to rounding
            torch.testing.assert_close(got, avg, rtol=1e-5, atol=1e-6, msg=f"step {step} rank {rank}")
            torch.testing.assert_close(residual, residuals[rank], rtol=1e-5, atol=1e-6,
                                       msg=f"residual, step {step} rank {rank}")
