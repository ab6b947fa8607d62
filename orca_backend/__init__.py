"""ORCA on Triton: iteration-level scheduling and selective batching for GPT-2 and Llama-family models.

The public names resolve lazily, so `import orca_backend.config` (as the client and orca-serve
do) never imports torch or the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orca_backend.config import EngineConfig, ModelConfig
    from orca_backend.llm import LLM, CompletionOutput
    from orca_backend.sampling_params import SamplingParams

_PUBLIC = {
    "LLM": "orca_backend.llm",
    "CompletionOutput": "orca_backend.llm",
    "EngineConfig": "orca_backend.config",
    "ModelConfig": "orca_backend.config",
    "SamplingParams": "orca_backend.sampling_params",
}
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "ModelConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'orca_backend' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
