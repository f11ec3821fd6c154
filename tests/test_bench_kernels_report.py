"""``gradcomp bench kernels`` report: fits 80 columns, numbers never cut, targets judged at full size only."""

from __future__ import annotations

import io

import pytest

from gradcomp.lab.bench import kernels as B

WIDTH = 80


def _row(name, kind="backend", **values):
    row = {"device": "cuda", "threads": "all", "op": "dequantize_int8_add_", "n": 2**24,
           "dtype": "bfloat16", "density": 0.001, "k": 16777, "name": name, "kind": kind,
           "median_s": 12.345678, "p10_s": 12.0, "p90_s": 99.999, "gbps": 1234.56}
    row.update(values)
    return row


def _widest_rows():
    # the longest names and the largest figures the benchmark prints (seconds-long medians,
    # ratios in the thousands), with every ratio column present
    ratios = {"vs_copy_bw": 12.34, "speedup_vs_reference": 1234.5, "speedup_vs_compiled": 1234.5,
              "speedup_vs_torch_topk": 1234.5, "speedup_vs_bitsandbytes": 1234.5,
              "time_vs_quantize": 12.34}
    return [_row("cpu", **ratios), _row("triton", **ratios), _row("bitsandbytes", "baseline"),
            _row("torch.topk", "baseline"), _row("reference", "baseline"),
            _row("compiled", "baseline"), _row("copy", "baseline", median_s=6.6e-5, gbps=None)]


def _report(result) -> str:
    buf = io.StringIO()
    B.print_report(result, file=buf)
    return buf.getvalue()


def test_widest_table_fits_80_columns_with_every_number_whole():
    rows = _widest_rows()
    text = _report({"rows": rows, "targets": B.check_targets(rows), "notes": ["x " * 120]})
    lines = text.splitlines()
    assert max(map(len, lines)) <= WIDTH, max(lines, key=len)
    assert "…" not in text
    # (milliseconds to 4 significant digits, 0.001 below 1 ms; the JSON keeps every digit)
    for figure in ("12346", "12000", "99999", "0.066", "1234.56", "1234%", "1234.5", "12.34"):
        assert figure in text, figure
    assert "cuda threads=all dequantize_int8_add_ bfloat16 n=2**24 density 0.001 (k=16777)" in lines
    # one heading per case: the case's fields are not repeated on each row
    assert sum("dequantize_int8_add_" in ln for ln in lines) == 1
    assert any(ln.split()[:2] == ["bitsandbytes", "12346"] for ln in lines)


def test_columns_empty_in_every_row_are_left_out():
    rows = [_row("cpu", speedup_vs_reference=3.0), _row("reference", "baseline")]
    header = " ".join(B.report_lines(rows)[1:3]).split()  # the timing and the ratio headers
    assert "ref" in header and "topk" not in header and "bnb" not in header and "ef/q" not in header


def _target_rows(n, value):
    return [{"device": "cpu", "name": "cpu", "dtype": "float32", "threads": "1", "op": "quantize_int8",
             "n": n, "density": None, "speedup_vs_reference": value}]


def test_targets_judged_only_at_full_size():
    (full,) = [t for t in B.check_targets(_target_rows(B.TARGET_SIZE, 1.0))
               if t["metric"] == "speedup_vs_reference"]
    assert full["judged"] and full["met"] is False
    assert "speedup_vs_reference >= 5.0: 1.00 -> MISSED" in _report(
        {"rows": [], "targets": [full], "notes": []})
    for quick, words in ((True, "not judged at quick sizes"), (False, "not judged at this size")):
        targets = B.check_targets(_target_rows(2**20, 1.0), quick)
        assert targets and all(not t["judged"] and t["met"] is None for t in targets)
        text = _report({"rows": [], "targets": targets, "notes": []})
        assert "MISSED" not in text and words in text
        assert "defined at n=2**24, measured at n=2**20" in text


def test_quick_run_output_fits_and_does_not_judge(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short --out: the closing "wrote PATH" line holds the user's path
    argv = ["--quick", "--sizes", "4096", "--ops", "quantize_int8", "--threads", "1", "--no-compile",
            "--repeat", "1", "--budget", "0.01", "--out", "bench-results"]
    assert B.main(argv) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= WIDTH
    assert "not judged at quick sizes" in out and "MISSED" not in out
    assert "cpu threads=1 quantize_int8 float32 n=2**12" in out


@pytest.mark.parametrize("text", ["0", "-3", "1.5", "2**100000", "lots"])
def test_bad_size_says_what_is_allowed(capsys, text):
    with pytest.raises(SystemExit) as e:
        B.main(["--size", text])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"--size: expected an integer >= 1: 1048576, 2**20, 2^20, 1e6, 64K, 16M or 1G (at most " \
           f"2**62), got {text!r}" in err
    assert "parse_size" not in err
