"""Integrations of gradcomp with other training libraries (torchft: :mod:`gradcomp.integrations.torchft`,
:mod:`gradcomp.integrations.torchft_localsgd`)."""

from gradcomp.integrations.torchft import ManagedAllreduce, comm_hook
from gradcomp.integrations.torchft_localsgd import ManagedLocalSGD

__all__ = ["ManagedAllreduce", "ManagedLocalSGD", "comm_hook"]
