"""gradcomp: gradient compression for distributed PyTorch training.

``import gradcomp as gc``; see README.md and the public names below. Importing
gradcomp does not load the native module, Triton or CuPy, nor initialise CUDA.
"""

from gradcomp.errors import BackendUnavailable, PayloadError
from gradcomp import kernels
from gradcomp.wire import Payload, decode
from gradcomp.compressors import (
    BF16,
    FP16,
    DGC,
    Compressor,
    ErrorFeedback,
    Int8Quantizer,
    NoCompression,
    Threshold,
    TopK,
)
from gradcomp.meter import TrafficMeter
from gradcomp.comm import allreduce
from gradcomp.adaptive import Adaptive
from gradcomp import ddp
from gradcomp.localsgd import LocalSGD
from gradcomp import ps

__version__ = "0.1.0"


def __getattr__(name: str):
    # gradcomp.fsdp imports torch.distributed.fsdp (about a second): loaded on first use
    if name == "fsdp":
        import importlib

        return importlib.import_module("gradcomp.fsdp")
    raise AttributeError(f"module 'gradcomp' has no attribute {name!r}")

__all__ = [
    "BackendUnavailable",
    "PayloadError",
    "Payload",
    "decode",
    "kernels",
    "Compressor",
    "NoCompression",
    "FP16",
    "BF16",
    "Int8Quantizer",
    "TopK",
    "Threshold",
    "ErrorFeedback",
    "DGC",
    "TrafficMeter",
    "allreduce",
    "Adaptive",
    "ddp",
    "LocalSGD",
    "ps",
    "fsdp",
]
