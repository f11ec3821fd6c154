"""The Lightning and Accelerate examples train 2 steps with gradcomp's int8 hook
(extra ``integrations``; skipped when the packages are missing)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_example(name: str) -> list[tuple[int, int, int]]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), "--steps", "2"],
                       capture_output=True, text=True, timeout=280, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    found = re.findall(r"^rank (\d): 2 steps, sent ([\d,]+) bytes, float32 ring would send ([\d,]+)",
                       r.stdout, re.M)
    return sorted((int(k), int(a.replace(",", "")), int(b.replace(",", ""))) for k, a, b in found)


def _check(ranks):
    assert [k for k, _, _ in ranks] == [0, 1]
    # the model: 256*512 + 512 + 512*10 + 10 float32 gradients in one DDP bucket; a 2-rank
    # float32 ring sends 2 (N-1)/N of them per step
    n = 256 * 512 + 512 + 512 * 10 + 10
    for _, sent, raw in ranks:
        assert raw == 2 * n * 4  # 2 steps x (2 x 1/2 x n x 4 bytes)
        assert sent > 0 and raw / sent >= 3.5


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="Lightning not installed: pip install 'gradcomp[integrations]'")
def test_lightning_ddp_strategy_with_gradcomp_hook():
    _check(_run_example("lightning_ddp.py"))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="Accelerate not installed: pip install 'gradcomp[integrations]'")
def test_accelerate_prepared_model_with_gradcomp_hook():
    _check(_run_example("accelerate_ddp.py"))


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="Lightning not installed: pip install 'gradcomp[integrations]'")
def test_lightning_strategy_takes_a_gradcomp_state_only():
    import gradcomp as gc
    from gradcomp.integrations.lightning import GradCompDDPStrategy

    s = GradCompDDPStrategy(gc.ddp.GradCompState(compressor=gc.Int8Quantizer()))
    assert s._ddp_comm_hook is gc.ddp.compressed_allreduce_hook
    with pytest.raises(TypeError, match="state must be a gradcomp.ddp.GradCompState"):
        GradCompDDPStrategy(object())
    with pytest.raises(TypeError, match="sets ddp_comm_hook itself"):
        GradCompDDPStrategy(gc.ddp.GradCompState(), ddp_comm_hook=print)
