"""Drop-in compressor objects (``compress`` / ``decompress`` / ``decompress_add_``).

Importing this package registers every built-in codec's :class:`Decoder` in
:data:`gradcomp.wire.CODECS`, so :func:`decompress` decodes any payload from
its bytes alone.
"""

from __future__ import annotations

from gradcomp.compressors.base import Compressor, Decoder, decoder, decompress, decompress_add_
from gradcomp.compressors.dense import BF16, FP16, NoCompression
from gradcomp.compressors.dgc import DGC, check_optimizer
from gradcomp.compressors.error_feedback import ErrorFeedback, split, unwrapped
from gradcomp.compressors.fp8 import FP8
from gradcomp.compressors.int8 import Int8Quantizer
from gradcomp.compressors.intq import IntQuantizer
from gradcomp.compressors.sign import SignQuantizer
from gradcomp.compressors.sparse import Threshold, TopK

__all__ = [
    "Compressor",
    "NoCompression",
    "FP16",
    "BF16",
    "Int8Quantizer",
    "IntQuantizer",
    "SignQuantizer",
    "FP8",
    "TopK",
    "Threshold",
    "ErrorFeedback",
    "DGC",
    "check_optimizer",
    "Decoder",
    "decoder",
    "decompress",
    "decompress_add_",
    "split",
    "unwrapped",
]
