"""Exceptions raised by gradcomp."""

from __future__ import annotations

__all__ = ["PayloadError", "BackendUnavailable"]


class PayloadError(ValueError):
    """Raised when wire bytes are malformed: truncated, corrupted, wrong magic or
    version, or sections whose sizes do not add up.

    Decoding untrusted bytes raises only this error; it never reads out of bounds.
    """


class BackendUnavailable(RuntimeError):
    """Raised when a kernel backend is requested explicitly (``backend=`` or
    ``GRADCOMP_BACKEND``) but cannot be used; the message gives the reason."""
