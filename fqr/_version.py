"""fqr's version: the one source of truth (pyproject.toml reads it: ``dynamic = ["version"]``)."""

__version__ = "0.1.0"
