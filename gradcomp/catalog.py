"""The named compressors: the one table behind every menu of compressor names.

``gradcomp train --compressors``, the planner, :class:`gradcomp.Adaptive`'s candidates and the
parameter-server demo all take their names from :data:`ENTRIES`, so a name means one codec
everywhere: ``int8`` is :class:`~gradcomp.Int8Quantizer`, ``int4`` / ``int2`` are
:class:`~gradcomp.IntQuantizer` at 4 / 2 bits, ``sign`` is :class:`~gradcomp.SignQuantizer`,
``fp8`` / ``fp8-e5m2`` are :class:`~gradcomp.FP8` (e4m3 / e5m2), ``topk`` top-k 1% with float32
values, ``topk-int8`` the same with int8 values; an ``-ef`` suffix asks the transport for error
feedback (``dgc``: Deep Gradient Compression's momentum-corrected residual). Block sizes (one
float32 scale per block): :data:`BLOCK` elements for the integer and fp8 codecs,
:data:`SIGN_BLOCK` for sign (1.03 bits per element). ``sign`` and ``int2`` without error feedback are biased
(they lose each step's error; sign SGD can diverge, Karimireddy et al. 2019): they are listed for
policies that keep residuals themselves (:class:`~gradcomp.Adaptive`); train with ``sign-ef`` /
``int2-ef``. Docs: docs/compressors.md#named-compressors. :func:`build` returns the
codec alone: the transport that runs it (a DDP hook state, a parameter-server worker, an
:class:`~gradcomp.Adaptive` policy) keeps the residuals. Importing this module imports no torch,
so that command-line parsers list the names without loading it; the codecs load in :func:`build`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradcomp.compressors import Compressor

__all__ = ["CatalogEntry", "ENTRIES", "NAMES", "TOPK_DENSITY", "DGC_DENSITY", "BLOCK", "SIGN_BLOCK", "entry",
           "build"]

#: density k / n of the ``topk*`` entries (and the target of ``threshold-ef``'s threshold)
TOPK_DENSITY = 0.01
#: final density of the ``dgc*`` entries, Deep Gradient Compression's 0.1% (Lin et al. 2018)
DGC_DENSITY = 0.001
#: block size (elements per float32 scale) of the int8, int4, int2 and fp8 entries, the classes'
#: default: the scale adds 0.125 bits per element
BLOCK = 256
#: block size of the sign entries, the class's default: at 256 the scales would add 12.5% to its
#: 1-bit codes; at 1024, 1.03 bits per element
SIGN_BLOCK = 1024


@dataclass(frozen=True)
class CatalogEntry:
    """One named compressor: what its name builds and what it asks of the transport.

    Attributes:
        name: the name every menu uses (``"int8-ef"``).
        label: the name shown in reports and tables (``"int8+ef"``).
        kind: its wire codec, a name of :data:`gradcomp.wire.CODECS` (``raw``,
            ``fp16``, ``bf16``, ``int8``, ``int4``, ``int2``, ``sign``, ``fp8e4m3``,
            ``fp8e5m2``, ``topk``, ``threshold``).
        values: codec of a sparse payload's kept values: ``raw`` (float32) or ``int8``.
        density: kept fraction k / n of a top-k (1.0 for a dense codec); for
            ``threshold`` the fraction its threshold is meant to keep (the
            study calibrates it so, the planner prices it so).
        error_feedback: the transport keeps a residual per tensor (Seide et al.
            2014; Karimireddy et al. 2019).
        dgc: that residual is Deep Gradient Compression's momentum-corrected
            velocity (:class:`gradcomp.DGC`, Lin et al. 2018), the optimizer's
            momentum moved in front of the compression.
        block_size: elements per float32 scale of a blockwise codec (int8, int4,
            int2, sign, fp8); None for the others.
    """

    name: str
    label: str
    kind: str
    values: str = "raw"
    density: float = 1.0
    error_feedback: bool = False
    dgc: bool = False
    block_size: int | None = None

    @property
    def sparse(self) -> bool:
        """Its payloads hold (indices, values) of some elements (the wire codec's ``sparse``)."""
        from gradcomp import wire  # imports torch: loaded on use, not when a parser lists names

        return wire.codec(self.kind).sparse

    def build(self, *, threshold: float | None = None, density: float | None = None,
              compact_indices: bool = True) -> "Compressor":
        """A fresh compressor of this entry, without error feedback (the transport adds it).

        Args:
            threshold: magnitude threshold (finite, >= 0) of a ``threshold`` entry:
                required there, refused elsewhere.
            density: kept fraction k / n in (0, 1] of a ``topk`` entry in place
                of its own (None: :attr:`density`); refused for other kinds.
            compact_indices: a sparse payload codes its indices compactly
                where smaller (False: fixed-width int32 indices).

        Returns:
            :class:`~gradcomp.NoCompression`, :class:`~gradcomp.FP16`,
            :class:`~gradcomp.BF16`, :class:`~gradcomp.Int8Quantizer`,
            :class:`~gradcomp.IntQuantizer` (4 or 2 bits, nearest rounding),
            :class:`~gradcomp.SignQuantizer`, :class:`~gradcomp.FP8` (e4m3 or e5m2),
            each at its :attr:`block_size`; :class:`~gradcomp.TopK` (exact select;
            values float32 or ``Int8Quantizer()``) or :class:`~gradcomp.Threshold`.

        Raises:
            ValueError: a missing or misplaced ``threshold``, a ``density``
                for an entry that is not a top-k or outside (0, 1].
        """
        import gradcomp.compressors as C  # imports torch: loaded on use, not when a parser lists names

        if threshold is not None and self.kind != "threshold":
            raise ValueError(f"threshold applies to threshold entries only, not {self.name!r}")
        if density is not None and self.kind != "topk":
            raise ValueError(f"density applies to top-k entries only, not {self.name!r}")
        if not self.sparse:  # the dense compressor that writes this wire codec
            blocks = {} if self.block_size is None else {"block_size": self.block_size}
            if self.kind.startswith("fp8"):  # fp8e4m3 / fp8e5m2
                return C.FP8(self.kind[3:], **blocks)
            if self.kind.startswith("int") and self.kind != "int8":  # int4 / int2
                return C.IntQuantizer(int(self.kind[3:]), **blocks)
            if self.kind == "sign":
                return C.SignQuantizer(**blocks)
            return next(cls for cls in (C.NoCompression, C.FP16, C.BF16, C.Int8Quantizer)
                        if cls.codec == self.kind)(**blocks)
        values = C.Int8Quantizer() if self.values == "int8" else None
        if self.kind == "threshold":
            if threshold is None:
                raise ValueError(f"{self.name} needs a threshold")
            return C.Threshold(threshold, values=values, compact_indices=compact_indices)
        return C.TopK(ratio=self.density if density is None else density, values=values,
                      compact_indices=compact_indices)


#: name -> :class:`CatalogEntry`, every named compressor
ENTRIES: dict[str, CatalogEntry] = {e.name: e for e in (
    CatalogEntry("none", "none", "raw"),
    CatalogEntry("fp16", "fp16", "fp16"),
    CatalogEntry("bf16", "bf16", "bf16"),
    CatalogEntry("int8", "int8", "int8", block_size=BLOCK),
    CatalogEntry("int8-ef", "int8+ef", "int8", error_feedback=True, block_size=BLOCK),
    CatalogEntry("fp8", "fp8", "fp8e4m3", block_size=BLOCK),
    CatalogEntry("fp8-ef", "fp8+ef", "fp8e4m3", error_feedback=True, block_size=BLOCK),
    CatalogEntry("fp8-e5m2", "fp8e5m2", "fp8e5m2", block_size=BLOCK),
    CatalogEntry("int4", "int4", "int4", block_size=BLOCK),
    CatalogEntry("int4-ef", "int4+ef", "int4", error_feedback=True, block_size=BLOCK),
    CatalogEntry("int2", "int2", "int2", block_size=BLOCK),  # biased without the residual: for policies keeping it
    CatalogEntry("int2-ef", "int2+ef", "int2", error_feedback=True, block_size=BLOCK),
    CatalogEntry("sign", "sign", "sign", block_size=SIGN_BLOCK),  # biased without the residual, as int2
    CatalogEntry("sign-ef", "sign+ef", "sign", error_feedback=True, block_size=SIGN_BLOCK),
    CatalogEntry("topk", "topk1%", "topk", "raw", TOPK_DENSITY),
    CatalogEntry("topk-ef", "topk1%+ef", "topk", "raw", TOPK_DENSITY, error_feedback=True),
    CatalogEntry("topk-int8", "topk1%+int8", "topk", "int8", TOPK_DENSITY),
    CatalogEntry("topk-int8-ef", "topk1%+int8+ef", "topk", "int8", TOPK_DENSITY, error_feedback=True),
    CatalogEntry("threshold-ef", "threshold+ef", "threshold", "raw", TOPK_DENSITY, error_feedback=True),
    CatalogEntry("dgc", "dgc0.1%", "topk", "raw", DGC_DENSITY, error_feedback=True, dgc=True),
    CatalogEntry("dgc-int8", "dgc0.1%+int8", "topk", "int8", DGC_DENSITY, error_feedback=True, dgc=True),
)}
#: every name, in the table's order
NAMES = tuple(ENTRIES)


def entry(name: str) -> CatalogEntry:
    """The entry named ``name``.

    Raises:
        ValueError: an unknown name (the message lists the allowed ones).
    """
    found = ENTRIES.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown compressor {name!r}; allowed: {', '.join(NAMES)}")
    return found


def build(name: str, **kwargs) -> "Compressor":
    """A fresh compressor named ``name``, without error feedback: ``entry(name).build(**kwargs)``
    (see :meth:`CatalogEntry.build`; ``build("int8-ef")`` is an ``Int8Quantizer()``, whose
    residual the transport keeps).

    Raises:
        ValueError: an unknown name, or arguments the entry refuses.
    """
    return entry(name).build(**kwargs)
