"""ember: a CPU-first LLM inference runtime built on torch.compile."""

from ember.lora.adapter import LoRARequest
from ember.runtime.config import EngineArgs, EngineConfig
from ember.runtime.engine import LLMEngine
from ember.runtime.llm import LLM
from ember.runtime.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from ember.runtime.request import RequestOutputKind, SamplingParams
from ember.runtime.structured import GuidedDecodingParams, StructuredOutputsParams
from ember.version import __version__

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "EngineConfig",
    "GuidedDecodingParams",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
