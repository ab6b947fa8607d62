"""ORCA on Triton: iteration-level scheduling and selective batching for GPT-2 and Llama-family models.

The public names resolve lazily, so `import orca_backend.config` (as the client and orca-serve
do) never imports torch or the engine. `ModelConfig` is GPT-2's config (families.gpt2.GPT2Config)
under the name this API has always given it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orca_backend.config import EngineConfig
    from orca_backend.entrypoints.llm import LLM, CompletionOutput
    from orca_backend.families.gpt2 import GPT2Config as ModelConfig
    from orca_backend.sampling_params import SamplingParams

# public name -> (module, its name there)
_PUBLIC = {
    "LLM": ("orca_backend.entrypoints.llm", "LLM"),
    "CompletionOutput": ("orca_backend.entrypoints.llm", "CompletionOutput"),
    "EngineConfig": ("orca_backend.config", "EngineConfig"),
    "ModelConfig": ("orca_backend.families.gpt2", "GPT2Config"),
    "SamplingParams": ("orca_backend.sampling_params", "SamplingParams"),
}
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "ModelConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'orca_backend' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    return getattr(importlib.import_module(module), attribute)
