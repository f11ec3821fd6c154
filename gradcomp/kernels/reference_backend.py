"""Registry entry for the pure-PyTorch reference: usable on every device."""

from __future__ import annotations

from gradcomp.kernels.reference import (  # noqa: F401  (re-exported ops)
    approx_topk,
    dequantize_int8,
    dequantize_int8_add_,
    quantize_int8,
    quantize_int8_ef,
    scatter_add_,
    threshold,
    topk,
)


def unavailable_reason() -> str | None:
    return None


def devices() -> frozenset[str]:
    """Every device type: the reference is plain torch."""
    return _ANY


class _Any(frozenset):
    def __contains__(self, item) -> bool:  # every device type
        return True


_ANY = _Any()
