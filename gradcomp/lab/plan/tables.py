"""The planner's tables as printed in a terminal, each within 80 columns.

The projection prints as two tables (sync: no compression against the fastest
compressor; then the communication shares and async) and a speed-up table that
names each codec's fastest algorithm; ``plan validate`` prints the step time and
idle share in one table and the exposed communication and bytes in another.
Long run labels wrap inside their cell; no cell is ever cut.
"""

from __future__ import annotations

from gradcomp.lab.plan.model import GAP_UNMEASURED

__all__ = ["WIDTH", "ALGORITHM_ABBREVIATIONS", "duration", "projection_tables", "speedup_table",
           "validation_tables", "breakdown_table"]

#: the terminal width every table fits (a terminal's default)
WIDTH = 80
#: short names of the algorithms in the tables
ALGORITHM_ABBREVIATIONS = {"ring": "R", "two_phase": "2P", "allgather": "AG", "halving_doubling": "HD",
                           "sparse_reduce_scatter": "SRS", "hierarchical": "H", "ps": "PS"}
_ALGORITHMS = ("R ring, 2P two-phase, HD halving-doubling, H hierarchical, AG allgather, "
               "SRS sparse reduce-scatter, PS parameter server")


def duration(seconds: float) -> str:
    """``3.1 ms``, ``655.8 ms``, ``15.48 s``, ``3,343 s``: at most 9 characters below 1e6 s."""
    if seconds < 1.0:
        return f"{1e3 * seconds:.1f} ms"
    return f"{seconds:.2f} s" if seconds < 100 else f"{seconds:,.0f} s"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _table(title: str, columns, rows, text: int = 2, wrap: int | None = None):
    """A table whose first ``text`` columns are left-aligned, the others right-aligned;
    ``wrap``: the first column's width, its text wrapped at spaces (never cut)."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
              show_edge=False, collapse_padding=True)
    for i, c in enumerate(columns):
        if i == 0 and wrap:
            t.add_column(c, justify="left", max_width=wrap, overflow="fold")
        else:
            t.add_column(c, justify="left" if i < text else "right", no_wrap=True)
    for r in rows:
        t.add_row(*r)
    return t


def _short(key: str) -> str:
    """``"int8/two_phase"`` -> ``"int8 2P"``."""
    name, alg = key.split("/")
    return f"{name} {ALGORITHM_ABBREVIATIONS[alg]}"


def projection_tables(rows: list[dict], cv: float) -> list:
    """The projection of :func:`gradcomp.lab.plan.project.project`'s ``rows`` as two tables."""
    from gradcomp.lab.units import format_count

    sync, other = [], []
    for r in rows:
        key = [format_count(r["params"]), r["link"], str(r["nodes"])]
        b = r["sync"][r["best_sync"]]
        sync.append(key + [duration(r["compute_s"]), duration(r["baseline"]["step_s"]), _short(r["best_sync"]),
                           duration(b["step_s"]), f"{r['speedup'][r['best_sync']]:.2f}x"])
        other.append(key + [_pct(r["comm_share_none"]), _pct(r["comm_share_best"]),
                            r["best_async"].split("/")[0], f"{r['async_over_sync']:.2f}x",
                            f"{r['staleness_best_async']:.1f}", _pct(r["idle_share"])])
    return [
        _table("sync step time: no compression (none on the ring) against the fastest compressor",
               ["params", "link", "N", "compute", "none", "fastest", "step", "speed-up"], sync, text=2),
        _table(f"share of the step spent communicating, async against sync, idle under stragglers "
               f"(compute CV {cv:g})",
               ["params", "link", "N", "comm\nnone", "comm\nfastest", "async\nbest", "async\n/sync",
                "stale", "idle"], other, text=2),
    ]


PROJECTION_LEGEND = (
    "N: data-parallel workers; compute: one worker's forward + backward per step; none, step: "
    "the predicted step time; fastest: the sync compressor and algorithm with the shortest step "
    f"({_ALGORITHMS}); comm: exposed communication over the step; async best: the parameter-server "
    "compressor with the most gradients applied per second, and async/sync its throughput over the "
    "fastest sync's; stale: its mean staleness in updates; idle: the share of a sync step the median "
    "worker waits for the slowest.")


def speedup_table(rows: list[dict]):
    """Per row, each codec's speed-up over none on the ring with its fastest algorithm
    (bf16 and threshold left out: fp16's bytes and kernels, an assumed density; and the codecs
    whose accuracy gap was not measured, :data:`gradcomp.lab.plan.model.GAP_UNMEASURED`: plan.json has them)."""
    from gradcomp.lab.units import format_count

    keys = [k for k in (rows[0]["speedup"] if rows else []) if not k.startswith(("bf16/", "threshold"))
            and k.split("/")[0] not in GAP_UNMEASURED]
    codecs = list(dict.fromkeys(k.split("/")[0] for k in keys))
    out = []
    for r in rows:
        cells = []
        for c in codecs:
            best = max((k for k in keys if k.split("/")[0] == c), key=lambda k: r["speedup"][k])
            x = r["speedup"][best]
            cells.append(f"{x:.{2 if x < 10 else 1}f} {ALGORITHM_ABBREVIATIONS[best.split('/')[1]]}")
        out.append([format_count(r["params"]), r["link"], str(r["nodes"])] + cells)
    # long codec names break at their hyphens into two header lines
    heads = [c.replace("-", "-\n", 1) if len(c) > 7 else c for c in codecs]
    return _table(f"speed-up over none on the ring of each codec on its fastest algorithm ({_ALGORITHMS}; "
                  "plan.json has every algorithm)", ["params", "link", "N", *heads], out, text=2)


def _opt(x, fmt) -> str:
    return "-" if x is None else fmt(x)


def validation_tables(out: dict, results: str) -> list:
    """``plan validate``'s rows as two tables: step time and idle share; exposed
    communication and bytes per step (measured against predicted)."""
    step, comm = [], []
    for r in out["rows"]:
        st, idle, b, ex = r["step_s"], r["idle_share"], r["bytes"], r["exposed_comm_s"]
        step.append([r["label"], duration(st["measured"]), duration(st["predicted"]),
                     f"{r['step_error_pct']:+.1f}%", _pct(idle["measured"]), _pct(idle["predicted"])])
        comm.append([r["label"], _opt(ex["measured"], duration), duration(ex["predicted"]),
                     _opt(b["measured"], lambda v: f"{v:,.0f}"), f"{b['predicted']:,.0f}"])
    return [_table(f"step time and idle share, measured against predicted ({results})",
                   ["run", "step", "predicted", "error", "idle", "predicted"], step, text=1, wrap=26),
            _table("exposed communication per step and bytes per worker step",
                   ["run", "exp. comm", "predicted", "bytes", "predicted"], comm, text=1, wrap=26)]


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:,.1f}"


def breakdown_table(groups: list[dict], terms: tuple[str, ...]):
    """Per (scenario, mode, compressor) group, the measured over the predicted
    step and model terms in milliseconds (two lines per row)."""
    rows = []
    for g in groups:
        m, p = g["terms"]["measured"], g["terms"]["predicted"]
        rows.append([f"{' '.join(g['group'])} ({g['runs']} runs)",
                     f"{_ms(g['step_s']['measured'])}\n{_ms(g['step_s']['predicted'])}",
                     f"{g['step_error_pct']:+.0f}%"]
                    + [f"{_ms(m[t]) if m else '-'}\n{_ms(p[t])}" for t in terms])
    return _table("per group, mean over its runs: each cell the measured milliseconds over the predicted "
                  "(codec = compress + decompress; comm = the rest of the exchange; apply = apply + other)",
                  ["group", "step", "error", *terms], rows, text=1, wrap=16)
