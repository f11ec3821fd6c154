"""The planner's menu of compressors: each :mod:`gradcomp.catalog` entry it prices, with the
accuracy gap ``recommend`` assumes for it (docs/planning.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from gradcomp import catalog

__all__ = ["PlanCodec", "CODECS", "CODEC_NAMES", "PLAN_NAMES", "GAP_PTS", "GAP_UNMEASURED", "plan_codec",
           "parse_plan_names"]

#: the compressors the planner prices, names of :mod:`gradcomp.catalog`
PLAN_NAMES = ("none", "fp16", "bf16", "int8", "int8-ef", "fp8", "fp8-ef", "fp8-e5m2", "int4", "int4-ef",
              "int2-ef", "sign-ef", "topk-ef", "topk-int8-ef", "threshold-ef")
#: accuracy gap in points ``recommend`` assumes per compressor (the default study's sync gap on
#: digits, docs/results/default-study.md; 0 where none was measurable)
GAP_PTS = {"topk-ef": 0.22, "topk-int8-ef": 0.22}
#: names whose accuracy gap no study in docs/results measured yet (gap_pts None): ``recommend``
#: ranks them only when asked for by name (an unknown gap is not a gap of 0)
GAP_UNMEASURED = ("fp8", "fp8-ef", "fp8-e5m2", "int4", "int4-ef", "int2-ef", "sign-ef")


@dataclass(frozen=True)
class PlanCodec:
    """One compressor of the planner's menu: a :mod:`gradcomp.catalog` entry's facts plus
    what the planner assumes of it.

    Attributes:
        name: the catalog name; label: its table label.
        kind: wire codec (``raw``, ``fp16``, ``bf16``, ``int8``, ``int4``, ``int2``, ``sign``,
            ``fp8e4m3``, ``fp8e5m2``, ``topk``, ``threshold``).
        values: codec of a sparse payload's kept values (``raw`` or ``int8``).
        density: kept fraction k / n of a sparse codec (threshold: an assumption).
        error_feedback: residual memory (adds its update to the kernel time).
        gap_pts: accuracy gap in points assumed by ``recommend`` (:data:`GAP_PTS`; None:
            not measured, :data:`GAP_UNMEASURED`).
        compact_indices: a sparse payload codes its indices compactly
            (Elias-Fano) where smaller, as the library does by default; False:
            fixed-width int32 indices (payloads written before compact indices).
    """

    name: str
    label: str
    kind: str
    values: str = "raw"
    density: float = 1.0
    error_feedback: bool = False
    gap_pts: float | None = 0.0
    compact_indices: bool = True

    @classmethod
    def of(cls, name: str) -> "PlanCodec":
        """The catalog entry ``name`` with the planner's assumptions.

        Raises:
            ValueError: a name the catalog does not know.
        """
        e = catalog.entry(name)
        gap = None if name in GAP_UNMEASURED else GAP_PTS.get(name, 0.0)
        return cls(e.name, e.label, e.kind, e.values, e.density, e.error_feedback, gap)

    @property
    def sparse(self) -> bool:
        from gradcomp import wire as W  # imports torch: loaded on use, not when a parser lists names

        return W.codec(self.kind).sparse

    @property
    def algorithms(self) -> tuple[str, ...]:
        """Allreduce algorithms that accept this codec (plus the parameter server)."""
        if self.sparse:  # the sparse reduce-scatter takes exact top-k (fixed payload sizes)
            return ("allgather", "sparse_reduce_scatter", "ps") if self.kind == "topk" else ("allgather", "ps")
        return ("ring", "two_phase", "halving_doubling", "hierarchical", "ps")

    def compressor(self, numel: int):
        """A compressor object with this codec's exact wire layout for ``numel``-element tensors."""
        compact = self.compact_indices
        if self.kind == "threshold":  # priced as a top-k payload at its assumed density: the same layout
            return catalog.build("topk-int8" if self.values == "int8" else "topk", density=self.density,
                                 compact_indices=compact)
        density = self.density if self.kind == "topk" else None
        return catalog.build(self.name, density=density, compact_indices=compact)

    def with_density(self, density: float) -> "PlanCodec":
        """The same sparse codec at another density."""
        if not self.sparse:
            raise ValueError(f"{self.name} is dense: density does not apply")
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        return replace(self, density=density)

    def with_compact_indices(self, compact: bool) -> "PlanCodec":
        """The same codec with compact (True) or fixed-width int32 (False) sparse indices."""
        return replace(self, compact_indices=bool(compact)) if self.sparse else self


CODECS: dict[str, PlanCodec] = {name: PlanCodec.of(name) for name in PLAN_NAMES}
CODEC_NAMES = tuple(CODECS)


def plan_codec(name: str) -> PlanCodec:
    """The menu entry ``name``.

    Raises:
        ValueError: unknown name (the message lists the allowed ones).
    """
    if name not in CODECS:
        raise ValueError(f"unknown compressor {name!r}; allowed: {', '.join(CODECS)}")
    return CODECS[name]


def parse_plan_names(text: str) -> tuple[str, ...]:
    """Comma-separated names of :data:`CODECS` (duplicates dropped, order kept).

    Raises:
        ValueError: none given, or an unknown name (the message lists the allowed ones).
    """
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ValueError(f"no compressor given; allowed: {', '.join(CODECS)}")
    for n in names:
        plan_codec(n)
    return names
