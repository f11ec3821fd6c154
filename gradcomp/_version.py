"""The version of gradcomp: its one source (pyproject.toml reads it, ``gradcomp.__version__`` is it)."""

__version__ = "0.1.0"
