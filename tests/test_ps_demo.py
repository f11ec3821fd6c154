"""The parameter-server demo (python -m gradcomp.ps): arguments, summary, learning rate."""

import json
import subprocess
import sys

import pytest

from gradcomp.lab.ps_demo import default_lr, main


@pytest.mark.parametrize("argv, words", [
    (["--world-size", "1"], "--world-size: expected an integer >= 2, got 1"),
    (["--steps", "-1"], "--steps: expected an integer >= 1, got -1"),
    (["--lr", "inf"], "--lr: expected a finite number > 0"),
    (["--world-size", "2", "--num-servers", "2"], "leaves no worker"),
    (["--link", "fast"], "--link: rate must be like"),
])
def test_bad_arguments_exit_2(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_default_lr_keeps_a_wide_problem_stable():
    # the largest curvature of A^T A / rows for Gaussian A: (1 + sqrt(dim/rows))^2
    assert default_lr(64, 256) == pytest.approx(0.5 / 2.25)
    assert default_lr(4096, 256) == pytest.approx(0.5 / 25.0)
    assert 0.1 * 25.0 > 2  # the old fixed lr 0.1 diverges there (step > 2 / L)


@pytest.mark.slow
def test_summary_and_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gradcomp.ps", "--steps", "20", "--dim", "4096",
                        "--rows", "256"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) <= 5 and "async parameter server, 1 server(s), 2 workers, 20 steps" in lines[0]
    assert "encrypted" not in lines[0]  # PLAIN by default
    dist = float(lines[3].rsplit(":", 1)[1])
    assert dist == dist and dist < 1e6  # finite: the default lr does not diverge
    r = subprocess.run([sys.executable, "-m", "gradcomp.ps", "--steps", "5", "--json", "--encrypt"],
                       capture_output=True, text=True, timeout=300)
    doc = json.loads(r.stdout)
    assert doc["updates"] == 10 and doc["link"]["name"] == "none"
    # no connection of the job was refused (a worker that closes a connection mid-handshake, as one
    # that finishes 5 steps before its heartbeat socket's CURVE handshake completes, counts apart)
    assert doc["security"] == "curve" and set(doc["refused_reasons"]) <= {"handshake not completed"}
