"""Drop-in compressor objects (``compress`` / ``decompress`` / ``decompress_add_``)."""

from __future__ import annotations

from gradcomp.compressors.base import Compressor
from gradcomp.compressors.dense import BF16, FP16, NoCompression
from gradcomp.compressors.dgc import DGC, check_optimizer
from gradcomp.compressors.error_feedback import ErrorFeedback
from gradcomp.compressors.int8 import Int8Quantizer
from gradcomp.compressors.sparse import Threshold, TopK

__all__ = [
    "Compressor",
    "NoCompression",
    "FP16",
    "BF16",
    "Int8Quantizer",
    "TopK",
    "Threshold",
    "ErrorFeedback",
    "DGC",
    "check_optimizer",
    "compressor_for_codec",
]


def compressor_for_codec(codec: str) -> Compressor:
    """A default compressor able to decode payloads of ``codec`` (dense codecs only)."""
    table = {"raw": NoCompression, "fp16": FP16, "bf16": BF16, "int8": Int8Quantizer}
    if codec not in table:
        raise ValueError(f"codec must be one of {tuple(table)}, got {codec!r}")
    return table[codec]()
