"""``gradcomp bench``'s output and option checks: the allreduce table within 80 columns with its
legend, and the kernel benchmark's options checked against this machine before anything runs."""

from __future__ import annotations

import json

import pytest
import torch

from gradcomp.lab.bench import allreduce as A
from gradcomp.lab.bench import kernels as B
from gradcomp.lab.bench.kernels import cli as kernels_cli

METHODS = [("torch all_reduce f32", "torch"), ("topk1%+int8 allgather", "gradcomp"),
           ("torch quantization_pertensor_hook", "torch hook"), ("torch powerSGD_hook rank 4", "torch hook")]


def _rows(link_rate):
    """The widest figures: seconds-long calls, ratios in the thousands, a shaped link's share."""
    rows = []
    for name, family in METHODS:
        rows.append({"world": 16, "numel": 2**24, "method": name, "family": family, "median_ms": 12345.6,
                     "bytes_per_rank": 1234.5 * 2**20, "compression_ratio": 1234.56, "rel_err": 0.9567,
                     "speedup_vs_f32": 123.45, "link": {"name": "100mbit" if link_rate else "none"},
                     "link_share": 0.987 if link_rate else None})
    return rows


@pytest.mark.parametrize("shaped", [False, True])
def test_allreduce_table_fits_80_columns_with_every_number_whole(shaped):
    lines = A.table_lines(_rows(shaped))
    assert max(map(len, lines)) <= A.WIDTH, max(lines, key=len)
    text = "\n".join(lines)
    for cell in ("12345.6", "123.5", "1234.500", "1234.56", "9.6e-01", "quantization_pertensor_hook",
                 "topk1%+int8 allgather", "16,777,216 float32 elements", "PyTorch DDP communication hooks:"):
        assert cell in text, cell
    assert ("98.7" in text and "link%" in text) == shaped
    assert "…" not in text


def test_the_legend_explains_every_header():
    for header in ("ms:", "x f32:", "MiB/rank:", "ratio:", "rel_err:", "link%:"):
        assert header in A.LEGEND
    assert "near 1" in A.LEGEND  # top-k's rel_err on random data


def _exit(capsys, argv):
    with pytest.raises(SystemExit) as e:
        B.main(argv)
    return e.value.code, capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_devices_cuda_without_cuda_is_one_line(capsys, tmp_path):
    code, err = _exit(capsys, ["--devices", "cuda", "--out", str(tmp_path)])
    assert code == 2 and err.count("\n") == 1
    assert "--devices cuda: no CUDA device here" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_devices_cpu_and_cuda_without_cuda_keeps_the_cpu_results(capsys, tmp_path):
    argv = ["--devices", "cpu,cuda", "--quick", "--sizes", "4096", "--ops", "quantize_int8", "--threads", "1",
            "--no-compile", "--repeat", "1", "--budget", "0.01", "--out", str(tmp_path)]
    assert B.main(argv) == 0
    out, err = capsys.readouterr()
    assert "cuda skipped: no CUDA device here" in err and "cuda skipped" in out
    doc = json.loads((tmp_path / "kernels.json").read_text())
    assert {r["device"] for r in doc["rows"]} == {"cpu"} and doc["rows"]
    assert any("cuda skipped" in n for n in doc["notes"])


def test_sizes_beyond_the_memory_are_one_line_before_any_allocation(capsys, tmp_path, monkeypatch):
    free = kernels_cli.available_memory_bytes()
    if free is None:
        pytest.skip("this machine does not say how much memory is available")
    n = 2**40
    assert kernels_cli.case_bytes(n, "float32") == n * (2 * 4 + 1 + 16)  # by hand: x, out, codes, 4 states
    code, err = _exit(capsys, ["--sizes", "2**40", "--out", str(tmp_path)])
    assert code == 2 and err.count("\n") == 1
    assert f"--sizes: {n} elements need about {n * 25 / 2**30:,.1f} GiB" in err and "available" in err
