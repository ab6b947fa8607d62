"""Thin shim: the `orca` model's logic lives in the installed orca_backend package."""

from orca_backend.server.orca_model import OrcaModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
