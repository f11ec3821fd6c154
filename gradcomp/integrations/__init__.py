"""Integrations with other training libraries, each imported on its own (an optional dependency
each): :mod:`gradcomp.integrations.lightning`, :mod:`gradcomp.integrations.torchft` and
:mod:`gradcomp.integrations.torchft_localsgd` (extra ``[ft]``)."""

__all__ = ()
