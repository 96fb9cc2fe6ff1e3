"""ember: a CPU-first LLM inference runtime built on torch.compile."""

from ember.lora.adapter import LoRARequest
from ember.runtime.config import EngineConfig
from ember.runtime.engine import LLMEngine
from ember.runtime.llm import LLM
from ember.runtime.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from ember.runtime.request import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
