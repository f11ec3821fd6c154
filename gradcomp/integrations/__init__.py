"""Integrations of gradcomp with other training libraries (torchft: :mod:`gradcomp.integrations.torchft`)."""

from gradcomp.integrations.torchft import ManagedAllreduce, comm_hook

__all__ = ["ManagedAllreduce", "comm_hook"]
