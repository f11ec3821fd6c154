"""The kernel benchmark's results: ratios against the peers, the targets check and the table.

:func:`add_ratios` adds to each backend row its ratios against the peers of the
same case, :func:`check_targets` compares them with :data:`TARGETS`, and
:func:`report_lines` / :func:`print_report` print them as plain text within
80 columns.
"""

from __future__ import annotations

import math
import sys
import textwrap

__all__ = [
    "TARGET_SIZE", "TARGETS", "add_ratios", "check_targets", "COLUMNS", "RATIO_COLUMNS", "WIDTH", "LEGEND",
    "report_lines", "print_report",
]

#: the size (elements) at which the targets are defined
TARGET_SIZE = 2**24

#: (op, density, metric, comparison, bound): checked on the CPU backend, float32,
#: one thread, n = 2**24 (or the largest size measured).
TARGETS = (
    ("quantize_int8", None, "vs_copy_bw", ">=", 0.80),
    ("quantize_int8", None, "speedup_vs_reference", ">=", 5.0),
    ("quantize_int8", None, "speedup_vs_compiled", ">=", 2.0),
    ("quantize_int8", None, "speedup_vs_bitsandbytes", ">=", 3.0),
    ("dequantize_int8", None, "vs_copy_bw", ">=", 0.60),
    ("dequantize_int8", None, "speedup_vs_reference", ">=", 5.0),
    ("dequantize_int8", None, "speedup_vs_compiled", ">=", 2.0),
    ("dequantize_int8", None, "speedup_vs_bitsandbytes", ">=", 3.0),
    ("quantize_int8_ef", None, "time_vs_quantize", "<=", 1.5),
    ("quantize_packed", None, "vs_copy_bw", ">=", 0.70),
    ("quantize_packed_2bit", None, "vs_copy_bw", ">=", 0.70),
    ("quantize_sign", None, "vs_copy_bw", ">=", 0.70),
    ("quantize_fp8", None, "vs_copy_bw", ">=", 0.70),
    ("topk", 0.01, "speedup_vs_torch_topk", ">=", 10.0),
    ("topk", 0.001, "speedup_vs_torch_topk", ">=", 10.0),
    ("approx_topk", 0.01, "speedup_vs_torch_topk", ">=", 20.0),
    ("approx_topk", 0.001, "speedup_vs_torch_topk", ">=", 20.0),
    ("threshold", 0.01, "vs_copy_bw", ">=", 0.40),
    ("threshold", 0.001, "vs_copy_bw", ">=", 0.40),
    ("dgc", 0.001, "time_vs_topk", "<=", 1.5),
    ("dgc", 0.01, "time_vs_topk", "<=", 1.5),
)


def add_ratios(rows: list[dict]) -> None:
    """Per backend row: ratios against the peers of the same case (added to the row)."""
    cases: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["device"], r["threads"], r["op"], r["n"], r["dtype"], r["density"])
        cases.setdefault(key, {})[r["name"]] = r
    for key, by_name in cases.items():
        copy = by_name.get("copy")
        for r in by_name.values():
            if r["kind"] != "backend":
                continue
            t = r["median_s"]
            if copy and copy.get("gbps") and r.get("gbps"):
                r["vs_copy_bw"] = r["gbps"] / copy["gbps"]
            for base, metric in (("reference", "speedup_vs_reference"), ("compiled", "speedup_vs_compiled"),
                                 ("torch.topk", "speedup_vs_torch_topk"),
                                 ("bitsandbytes", "speedup_vs_bitsandbytes")):
                if base in by_name and base != r["name"] and t > 0:
                    r[metric] = by_name[base]["median_s"] / t
            for base, metric in (("topk", "time_vs_topk"), ("topk+ef", "time_vs_topk_ef")):
                if r["op"] == "dgc" and base in by_name and by_name[base]["median_s"] > 0:
                    r[metric] = t / by_name[base]["median_s"]
            if r["op"] == "quantize_int8_ef":
                qkey = key[:2] + ("quantize_int8",) + key[3:]
                plain = cases.get(qkey, {}).get(r["name"])
                if plain:
                    r["time_vs_quantize"] = t / plain["median_s"]


def check_targets(rows: list[dict], quick: bool = False) -> list[dict]:
    """The TARGETS against the CPU backend's rows (float32, 1 thread) at n = TARGET_SIZE.

    Without that size (``--quick``, ``--size``) the largest measured size is shown
    with ``judged`` False and ``met`` None: the bounds hold at full size only.
    """
    cpu_rows = [r for r in rows if r["device"] == "cpu" and r["name"] == "cpu" and r["dtype"] == "float32"
                and r["threads"] == "1"]
    if not cpu_rows:
        return []
    sizes = sorted({r["n"] for r in cpu_rows})
    n = TARGET_SIZE if TARGET_SIZE in sizes else sizes[-1]
    out = []
    for op, density, metric, cmp, bound in TARGETS:
        match = [r for r in cpu_rows if r["op"] == op and r["n"] == n
                 and (density is None or r["density"] == density)]
        if not match:
            continue
        v = match[0].get(metric)
        judged = n == TARGET_SIZE
        ok = None if v is None or not judged else (v >= bound if cmp == ">=" else v <= bound)
        out.append({"op": op, "density": density, "n": n, "metric": metric, "target": f"{cmp} {bound}",
                    "value": v, "met": ok, "judged": judged, "quick": quick})
    return out

# ---------------------------------------------------------------------------
# the table


def _size(n: int) -> str:
    if n and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    return str(n)


#: (header, row key, format) of the report's columns: the timing columns on a row's first line,
#: the ratio columns on its second (backend rows only); a case's device, threads, op, dtype, size
#: and density head its group of rows instead of repeating on each row.
COLUMNS = (
    ("median ms", "median_s", "ms"), ("p10", "p10_s", "ms"), ("p90", "p90_s", "ms"),
    ("GB/s", "gbps", ".2f"), ("%copy", "vs_copy_bw", "%"),
)
RATIO_COLUMNS = (
    ("x ref", "speedup_vs_reference", ".1f"), ("x comp", "speedup_vs_compiled", ".1f"),
    ("x topk", "speedup_vs_torch_topk", ".1f"), ("x bnb", "speedup_vs_bitsandbytes", ".1f"),
    ("ef/q", "time_vs_quantize", ".2f"), ("/topk", "time_vs_topk", ".2f"),
    ("/topk+ef", "time_vs_topk_ef", ".2f"),
)
#: the width every line of the report fits (a terminal's default)
WIDTH = 80
LEGEND = ("Each backend's second line: x ref / x comp / x topk / x bnb: time of the reference / fused "
          "torch.compile peer / torch.topk / bitsandbytes over the backend's; ef/q: time over the same "
          "backend's quantize_int8; /topk, /topk+ef (dgc): time over top-k's, and over top-k with error "
          "feedback's. %copy: bandwidth over numpy copy's; p10, p90: percentiles of the rounds.")


def _cell(v, spec: str) -> str:
    if v is None:
        return ""
    if spec == "ms":  # milliseconds: 4 significant digits from 1 ms up, 0.001 ms below
        ms = v * 1e3
        decimals = 3 if ms < 1 else max(0, 3 - int(math.log10(ms)))
        return f"{ms:.{decimals}f}"
    if spec == "%":
        return f"{100 * v:.0f}%"
    return format(v, spec)


def _case_title(r: dict) -> str:
    dens = "" if r["density"] is None else f" density {r['density']:g} (k={r['k']})"
    return f"{r['device']} threads={r['threads']} {r['op']} {r['dtype']} n={_size(r['n'])}{dens}"


def _aligned(cells: list[str], widths: list[int], indent: int, first_left: bool) -> str:
    out = [c.ljust(w) if i == 0 and first_left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
    return (" " * indent + "  ".join(out)).rstrip()


def report_lines(rows: list[dict]) -> list[str]:
    """The result table as plain text lines within :data:`WIDTH` columns, every number in full.

    Two header lines (the timing columns; the ratio columns, indented), then one
    heading line per case (device, threads, op, dtype, size, density) and per
    backend or baseline a line of timings; a backend with ratios gets a second
    line of them under the ratio header. Columns empty in every row are left out.
    """
    cols = [c for c in COLUMNS if any(r.get(c[1]) is not None for r in rows)]
    ratios = [c for c in RATIO_COLUMNS if any(r.get(c[1]) is not None for r in rows)]
    first = [[r["name"], *(_cell(r.get(key), spec) for _, key, spec in cols)] for r in rows]
    second = [[_cell(r.get(key), spec) for _, key, spec in ratios] for r in rows]
    head = ["name", *(h for h, _, _ in cols)]
    rhead = [h for h, _, _ in ratios]
    widths = [max([len(h), *(len(b[i]) for b in first)]) for i, h in enumerate(head)]
    rwidths = [max([len(h), *(len(b[i]) for b in second)]) for i, h in enumerate(rhead)]
    out = ["gradcomp kernels (median of interleaved rounds)", _aligned(head, widths, 2, True),
           _aligned(rhead, rwidths, 4, False)]
    prev = None
    for r, line, ratio in zip(rows, first, second):
        title = _case_title(r)
        if title != prev:
            out.append(title)
            prev = title
        out.append(_aligned(line, widths, 2, True))
        if any(ratio):
            out.append(_aligned(ratio, rwidths, 4, False))
    return out


def _target_status(t: dict) -> str:
    if not t.get("judged", True):
        return "not judged at quick sizes" if t.get("quick") else "not judged at this size"
    return {True: "met", False: "MISSED", None: "not measured"}[t["met"]]


def print_report(result: dict, file=None) -> None:
    """Print the table (:func:`report_lines`), the legend, the targets check and the notes,
    all within :data:`WIDTH` columns (long notes wrap)."""
    file = file or sys.stdout
    for text in report_lines(result["rows"]):
        print(text, file=file)
    build = result.get("meta", {}).get("native_build") or {}
    if build.get("isa"):
        print(textwrap.fill(f"cpu backend's kernels: {build['isa']} (this CPU runs "
                            f"{build.get('isa_supported')}; GRADCOMP_CPU_ISA forces one)", width=WIDTH), file=file)
    print(textwrap.fill(LEGEND, width=WIDTH), file=file)
    if result["targets"]:  # one size for all: check_targets measures at one n
        n = result["targets"][0]["n"]
        at = "" if n == TARGET_SIZE else f", measured at n={_size(n)}"
        print(f"targets (cpu, float32, 1 thread; defined at n={_size(TARGET_SIZE)}{at}):", file=file)
    for t in result["targets"]:
        v = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        dens = f" density {t['density']}" if t["density"] is not None else ""
        print(textwrap.fill(f"  {t['op']}{dens} {t['metric']} {t['target']}: {v} -> {_target_status(t)}",
                            width=WIDTH, subsequent_indent="      "), file=file)
    for note in result["notes"]:
        print(textwrap.fill(f"note: {note}", width=WIDTH, subsequent_indent="  "), file=file)


