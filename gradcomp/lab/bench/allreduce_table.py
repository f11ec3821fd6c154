"""The allreduce benchmark's table: text lines within 80 columns and the legend under them."""

from __future__ import annotations

__all__ = ["WIDTH", "LEGEND", "table_lines"]

WIDTH = 80
LEGEND = ("ms: median time of one allreduce on the slowest rank; x f32: torch all_reduce's time over "
          "the method's; MiB/rank: wire MiB rank 0 sent per call (torch: a ring's nominal volume); ratio: "
          "a float32 ring's bytes over the bytes sent; rel_err: ||result - exact mean|| / ||exact mean|| "
          "on the first call (top-k keeps 1% of the coordinates of random data, whose energy is spread "
          "evenly, so its error is near 1; on real gradients error feedback carries the rest to later "
          "steps); link%: bytes sent per second over the configured link rate (shaped links only); "
          "auto=X: the algorithm auto settled on (R ring, 2P two-phase, HD halving-doubling, H "
          "hierarchical, AG allgather, SRS sparse reduce-scatter).")
#: the auto methods' choice as the table names it
_SHORT = {"ring": "R", "two_phase": "2P", "halving_doubling": "HD", "hierarchical": "H", "allgather": "AG",
          "sparse_reduce_scatter": "SRS"}


def _method_cell(r: dict) -> str:
    """The method's name in the table: PyTorch's hooks without the ``torch`` prefix (under
    their own heading); an auto method with its choice."""
    if r.get("auto_choice"):
        return f"{r['method']}={_SHORT.get(r['auto_choice'], r['auto_choice'])}"
    return r["method"].removeprefix("torch ") if r["family"] == "torch hook" else r["method"]


def table_lines(rows) -> list[str]:
    """The results as text lines within :data:`WIDTH` columns, every number whole: a heading
    line per (link, world, size), then a line per method (PyTorch's DDP hooks under a
    heading of their own); ``link%`` only on shaped links."""
    shaped = any(r.get("link_share") is not None for r in rows)
    heads = ["method", "ms", "x f32", "MiB/rank", "ratio", "rel_err", *(["link%"] if shaped else [])]
    cells = []
    for r in rows:
        ratio = f"{r['compression_ratio']:.2f}" if r["compression_ratio"] else "-"
        share = f"{100 * r['link_share']:.1f}" if r.get("link_share") is not None else "-"
        x = r["speedup_vs_f32"]
        cells.append([_method_cell(r), f"{r['median_ms']:.1f}", f"{x:.{2 if x < 100 else 1}f}",
                      f"{r['bytes_per_rank'] / 2**20:.3f}", ratio, f"{r['rel_err']:.1e}",
                      *([share] if shaped else [])])
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, h in enumerate(heads)]

    def line(cs):
        return "  " + "  ".join([cs[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(cs[1:], widths[1:]))])
    out = [line(heads).rstrip(), "  " + "-" * (len(line(heads)) - 2)]
    prev, hooks = None, None
    for r, cs in zip(rows, cells):
        case = (r["link"]["name"], r["world"], r["numel"])
        if case != prev:
            where = "loopback" if r["link"]["name"] == "none" else f"link {r['link']['name']}"
            out.append(f"{where}, world {r['world']}, {r['numel']:,} float32 elements")
            prev, hooks = case, False
        if r["family"] == "torch hook" and not hooks:
            out.append("  PyTorch DDP communication hooks:")
            hooks = True
        out.append(line(cs).rstrip())
    return out
