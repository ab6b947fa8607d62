"""ORCA on Triton: iteration-level scheduling and selective batching for GPT-2 family models."""

from orca_backend.config import EngineConfig, ModelConfig
from orca_backend.llm import LLM, CompletionOutput
from orca_backend.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "ModelConfig", "SamplingParams"]
