"""Integrations with training frameworks, each imported on its own (``gradcomp.integrations.lightning``)."""
