"""ember: a CPU-first LLM inference runtime built on torch.compile.

The public names below are imported on first use (PEP 562), so that `import ember.kernels`
(and the `ember` command, which starts the one-time kernel build first: `ember.entry`) does not
pay for transformers and the runtime (about 3 s)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ember.version import __version__

if TYPE_CHECKING:
    from ember.lora.adapter import LoRARequest
    from ember.runtime.config import EngineArgs, EngineConfig
    from ember.runtime.engine import LLMEngine
    from ember.runtime.llm import LLM
    from ember.runtime.outputs import (
        ClassificationOutput,
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        Logprob,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from ember.runtime.request import RequestOutputKind, SamplingParams
    from ember.runtime.structured import GuidedDecodingParams, StructuredOutputsParams

_EXPORTS = {
    "LLM": "ember.runtime.llm",
    "ClassificationOutput": "ember.runtime.outputs",
    "ClassificationRequestOutput": "ember.runtime.outputs",
    "CompletionOutput": "ember.runtime.outputs",
    "EmbeddingOutput": "ember.runtime.outputs",
    "EmbeddingRequestOutput": "ember.runtime.outputs",
    "EngineArgs": "ember.runtime.config",
    "EngineConfig": "ember.runtime.config",
    "GuidedDecodingParams": "ember.runtime.structured",
    "LLMEngine": "ember.runtime.engine",
    "LoRARequest": "ember.lora.adapter",
    "Logprob": "ember.runtime.outputs",
    "RequestOutput": "ember.runtime.outputs",
    "RequestOutputKind": "ember.runtime.request",
    "SamplingParams": "ember.runtime.request",
    "ScoringOutput": "ember.runtime.outputs",
    "ScoringRequestOutput": "ember.runtime.outputs",
    "StructuredOutputsParams": "ember.runtime.structured",
}

__all__ = [
    "LLM",
    "ClassificationOutput",
    "ClassificationRequestOutput",
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
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
