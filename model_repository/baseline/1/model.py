"""Thin shim: the `baseline` model's logic lives in the installed orca_backend package."""

from orca_backend.server.baseline_model import BaselineModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
