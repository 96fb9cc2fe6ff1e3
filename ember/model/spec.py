"""What ember needs to know about a checkpoint, read once from its HF config: the task, how to
load it, its attention features and its KV geometry (`ModelSpec`)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
)
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_MAPPING_NAMES,
)

from ember.attention import AttentionFeatures
from ember.errors import UnsupportedModelError
from ember.model.architectures import (
    ATTENTION_SINKS,
    check_architecture,
    refuse_known,
    require_checked,
)

# "generate" (causal LM), "encdec" (encoder-decoder LM), "embed" (encoder-only model) or
# "classify" (a sequence classifier: a cross-encoder reranker, or a causal LM with a score head).
TASKS = ("generate", "encdec", "embed", "classify")
_AUTO_CLASSES: dict[str, Any] = {
    "generate": AutoModelForCausalLM,
    "encdec": AutoModelForSeq2SeqLM,
    "embed": AutoModel,
    "classify": AutoModelForSequenceClassification,
}
# Tasks whose requests are pooled (one whole prompt per step, no sampling).
POOLED_TASKS = ("embed", "classify")


# model_types of the vision-language models ember serves (task "generate", images through
# cross-attention; `ModelSpec.multimodal`).
MULTIMODAL_MODEL_TYPES = ("mllama",)


@dataclass(frozen=True)
class ModelSpec:
    """Facts about one checkpoint, computed once by `read_model_spec`.

    `num_kv_layers, num_kv_heads, head_dim`: the config's KV geometry (encoder-decoder models keep
    encoder and decoder layers in the same per-layer caches: the larger layer count). Models
    whose layers differ (Gemma 4) are measured per layer from the loaded modules
    (`ember.model.loader.kv_layer_shapes`).
    """

    model_dir: str
    hf_config: PretrainedConfig = field(compare=False, repr=False)
    task: str
    architecture: str
    checkpoint_dtype: torch.dtype | None
    max_positions: int
    num_kv_layers: int
    num_kv_heads: int
    head_dim: int
    # The checkpoint is this GGUF file (in `model_dir`), not an HF directory.
    gguf_file: str | None = None
    # A vision-language model (`MllamaForConditionalGeneration`): its model_type. Its images
    # reach the language model through cross-attention layers (`ember.runtime.multimodal`).
    multimodal: str | None = None
    # Where a pooled encoder's position ids start (`_position_offset`): RoBERTa-style
    # embeddings number an unpadded sequence from pad_token_id + 1; `max_positions` is what
    # the table holds past that.
    position_offset: int = 0

    @property
    def auto_class(self) -> Any:
        if self.multimodal is not None:
            return AutoModelForImageTextToText
        return _AUTO_CLASSES[self.task]

    @property
    def causal_classifier(self) -> bool:
        """A sequence classifier over a causal LM (`LlamaForSequenceClassification`): causal
        attention, the last token pooled; else (BERT-style cross-encoders) bidirectional."""
        if self.task != "classify":
            return False
        model_cls = _AUTO_CLASSES["classify"]._model_mapping[type(self.hf_config)]
        return issubclass(model_cls, GenericForSequenceClassification)

    @property
    def text_config(self) -> PretrainedConfig:
        """The language model's config (the whole config for text-only models)."""
        return self.hf_config.get_text_config()

    def attention_features(
        self, kv_dtype: torch.dtype, activation_dtype: torch.dtype | None = None
    ) -> AttentionFeatures:
        """What the model's attention layers need from a backend (queries in
        `activation_dtype`, `kv_dtype` when not given)."""
        config = self.text_config
        layer_types = getattr(config, "layer_types", None) or ()
        window = getattr(config, "sliding_window", None)
        sliding = "sliding_attention" in layer_types or bool(
            window and getattr(config, "use_sliding_window", True)
        )
        return AttentionFeatures(
            kv_dtype=kv_dtype,
            activation_dtype=activation_dtype,
            sliding_window=sliding,
            softcap=bool(getattr(config, "attn_logit_softcapping", None)),
            bidirectional=self.task in ("embed", "encdec")
            or (self.task == "classify" and not self.causal_classifier),
            cross_attention=self.task == "encdec" or self.multimodal is not None,
            kv_sharing=bool(getattr(config, "num_kv_shared_layers", 0)),
            sinks=self.hf_config.model_type in ATTENTION_SINKS,
        )


def read_model_spec(model_dir: str) -> ModelSpec:
    """Read a local checkpoint directory's config, or a GGUF file's metadata (offline), and
    classify it; raises `UnsupportedModelError` naming the architecture for anything ember
    cannot serve."""
    gguf_file = None
    if is_gguf(model_dir):
        from ember.model.gguf.hf import load_gguf_config

        config = load_gguf_config(model_dir)
        gguf_file = os.path.abspath(model_dir)
        model_dir = os.path.dirname(gguf_file)
    else:
        config = load_hf_config(model_dir)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    task = model_task(config)  # first: it refuses what the geometry below cannot read
    text = config.get_text_config()
    num_layers, num_kv_heads, head_dim = kv_geometry(text)
    offset = _position_offset(config, task)
    return ModelSpec(
        model_dir=model_dir,
        hf_config=config,
        task=task,
        architecture=(getattr(config, "architectures", None) or [config.model_type])[0],
        checkpoint_dtype=dtype if isinstance(dtype, torch.dtype) else None,
        max_positions=(getattr(text, "max_position_embeddings", None) or 1 << 16) - offset,
        num_kv_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        gguf_file=gguf_file,
        multimodal=config.model_type if config.model_type in MULTIMODAL_MODEL_TYPES else None,
        position_offset=offset,
    )


# Files a checkpoint needs from a hub repository (never its .bin/.pt pickles or GGUF copies
# unless asked for).
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja", "*.py"]


def resolve_model(model: str, revision: str | None = None, load_format: str = "safetensors") -> str:
    """A local path for `model`: itself when it exists, else a Hugging Face hub id ("org/name")
    resolved through `huggingface_hub` as transformers and vLLM do: the local HF cache
    (`HF_HUB_CACHE`), downloading only where the machine is online and `HF_HUB_OFFLINE` is
    unset. Raises ValueError naming the id when neither works."""
    if os.path.exists(model) or is_gguf(model):
        if revision is not None and os.path.isdir(model):
            raise ValueError(f"revision={revision!r} needs a hub id, but {model!r} is a directory")
        return model
    from huggingface_hub import snapshot_download  # noqa: PLC0415
    from huggingface_hub.utils import HFValidationError  # noqa: PLC0415

    patterns = _HUB_PATTERNS + (["*.bin"] if load_format == "auto" else [])
    try:
        return snapshot_download(model, revision=revision, allow_patterns=patterns)
    except HFValidationError as e:
        raise ValueError(
            f"model must be a local checkpoint directory, a GGUF file or a hub id, got "
            f"{model!r}: {e}"
        ) from e
    except Exception as e:  # noqa: BLE001  (offline, not cached, unknown repo or revision)
        raise ValueError(
            f"model {model!r} (revision {revision or 'main'}) is neither a local directory nor "
            f"in the Hugging Face cache, and could not be downloaded: {type(e).__name__}: {e}"
        ) from e


def is_gguf(model: str) -> bool:
    """True when `model` names a GGUF file (by extension; the file is checked when read)."""
    return model.lower().endswith(".gguf")


# "safetensors": only safetensors weights load; "auto": safetensors, else PyTorch .bin files.
LOAD_FORMATS = ("safetensors", "auto")


def check_weights_format(model_dir: str, load_format: str) -> None:
    """Refuse a checkpoint whose weights are only PyTorch pickles (`*.bin`) unless
    `load_format="auto"` opts in: unpickling is code execution in the general case (transformers
    reads them with torch.load(weights_only=True), a restricted unpickler)."""
    if load_format != "safetensors" or not os.path.isdir(model_dir):
        return
    files = os.listdir(model_dir)
    if any(f.endswith(".safetensors") for f in files):
        return
    pickles = sorted(f for f in files if f.endswith((".bin", ".pt", ".pth")) and "model" in f)
    if pickles:
        raise UnsupportedModelError(
            f"checkpoint {model_dir!r} has only PyTorch pickle weights ({', '.join(pickles[:3])}),"
            " no safetensors; convert it to safetensors, or pass load_format='auto' "
            "(--load-format auto) to load the pickle"
        )


def load_hf_config(model_dir: str) -> PretrainedConfig:
    """Read `config.json` of a local checkpoint directory, offline."""
    if not os.path.isdir(model_dir):
        raise ValueError(f"model must be a local checkpoint directory, got {model_dir!r}")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise UnsupportedModelError(f"model directory {model_dir!r} has no config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (ValueError, OSError) as e:
        raise UnsupportedModelError(f"config.json of {model_dir!r} is not valid JSON: {e}") from e
    try:
        # Never the checkpoint's own code: ember runs transformers' model classes only.
        return AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001  (unknown model_type, or a config its class rejects)
        arch = (raw.get("architectures") or [raw.get("model_type")])[0]
        raise UnsupportedModelError(
            f"transformers cannot read the config of architecture {arch!r} in {model_dir!r}: "
            f"{type(e).__name__}: {e}"
        ) from e


def _position_offset(config: PretrainedConfig, task: str) -> int:
    """Where a pooled encoder's position ids start: RoBERTa-style embeddings (XLM-R,
    CamemBERT, MPNet, ...: their module's embeddings derive positions from the input ids) number
    an unpadded sequence from `pad_token_id + 1`, as HF's forward does when given no position
    ids; others from 0. Its max_position_embeddings include the positions skipped."""
    if task not in POOLED_TASKS:
        return 0
    model_cls = _AUTO_CLASSES[task]._model_mapping[type(config)]
    module = vars(sys.modules[model_cls.__module__])
    roberta_style = any(
        hasattr(obj, "create_position_ids_from_input_ids")
        for obj in module.values()
        if isinstance(obj, type)
    )
    pad = getattr(config, "pad_token_id", None)
    return int(pad) + 1 if roberta_style and pad is not None else 0


def model_task(config: PretrainedConfig) -> str:
    """ "generate" for a causal LM, "encdec" for an encoder-decoder LM (`BartForConditional
    Generation`), "embed" for an encoder-only base model (`BertModel`), "classify" for a
    sequence classifier (`BertForSequenceClassification`, `Qwen2ForSequenceClassification`);
    raises naming the architecture for anything else."""
    declared = getattr(config, "architectures", None)
    arch = (declared or [config.model_type])[0]
    causal_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    base_name = MODEL_MAPPING_NAMES.get(config.model_type)
    seq2seq_name = MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    classify_name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    vlm_name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type)
    if config.model_type in MULTIMODAL_MODEL_TYPES and declared and vlm_name in declared:
        model_cls = AutoModelForImageTextToText._model_mapping[type(config)]
        if "ALL_ATTENTION_FUNCTIONS" not in vars(sys.modules[model_cls.__module__]):
            raise UnsupportedModelError(
                f"architecture {arch!r} does not route attention through transformers' "
                "attention interface, so ember cannot capture it"
            )
        check_architecture(config)
        return "generate"
    if getattr(config, "is_encoder_decoder", False):
        if seq2seq_name is None or (declared and seq2seq_name not in declared):
            raise UnsupportedModelError(
                f"architecture {arch!r} is encoder-decoder but not a conditional-generation LM"
            )
        enc_heads = getattr(config, "encoder_attention_heads", None)
        if enc_heads != getattr(config, "decoder_attention_heads", enc_heads):
            raise UnsupportedModelError(
                f"architecture {arch!r}: encoder and decoder head counts differ; ember keeps both "
                "in one KV cache and needs them equal"
            )
        task = "encdec"
    elif classify_name is not None and declared and classify_name in declared:
        task = "classify"
    elif causal_name is not None and (not declared or causal_name in declared):
        task = "generate"
    elif base_name is not None and declared and base_name in declared:
        task = "embed"
    else:
        raise UnsupportedModelError(
            f"architecture {arch!r} (model_type {config.model_type!r}) is neither a causal LM "
            "nor an encoder base model that ember can capture"
        )
    model_cls = _AUTO_CLASSES[task]._model_mapping[type(config)]
    # A causal LM's classifier runs the same layers as the LM: the same tables decide it.
    lm_layers = task == "generate" or issubclass(model_cls, GenericForSequenceClassification)
    if lm_layers:
        refuse_known(config)  # a reason of its own comes before the routing check
    # HF flags models tested with custom attention functions; BART-family models do not carry
    # the flag but dispatch every attention call through the same registry.
    routes = "ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[model_cls.__module__])
    if not (getattr(model_cls, "_supports_attention_backend", False) or routes):
        raise UnsupportedModelError(
            f"architecture {arch!r} does not route attention through transformers' attention "
            "interface, so ember cannot capture it"
        )
    if lm_layers:
        require_checked(config)
    return task


def _global_value(config: PretrainedConfig, name: str) -> Any:
    """`config.<name>`, or its serialized global value for heterogeneous configs (Gemma 4),
    which refuse a global read of a per-layer field; per-layer values come from the modules
    (`kv_layer_shapes`)."""
    try:
        return getattr(config, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return config.to_dict().get(name)


def kv_geometry(config: PretrainedConfig) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the text model. Encoder-decoder models keep
    encoder and decoder layers in the same per-layer caches: max of the two layer counts."""
    num_heads = config.num_attention_heads
    num_kv_heads = _global_value(config, "num_key_value_heads") or num_heads
    head_dim = _global_value(config, "head_dim") or config.hidden_size // num_heads
    num_layers = max(
        config.num_hidden_layers,
        getattr(config, "encoder_layers", 0) or 0,
        getattr(config, "decoder_layers", 0) or 0,
    )
    return num_layers, num_kv_heads, head_dim
