"""Which causal-LM architectures ember runs exactly, and why it refuses the others.

ember runs an unmodified transformers model with its attention routed to ember's paged op.
That is exact only where everything the model keeps between tokens lives in the attention
K/V that the op caches, and where each decoder layer hands the per-step metadata through to
its attention call. An architecture is served only when it is in `EXACT`, which
`tests/architectures` checks token for token against HF `generate` (fp32, greedy, chunked
prefill, a prompt longer than the sliding window); every other one is refused at load with
`UnsupportedModelError` naming what ember lacks. Silent wrong tokens are the one outcome
this table exists to rule out.

`EMBER_ALLOW_UNVERIFIED_ARCHITECTURES=1` lets an architecture that is in neither table (one
newer than this table's transformers) load with a warning, for a user who checks its output
themselves; the known-refused ones stay refused.
"""

from __future__ import annotations

import logging
import os

from transformers import PretrainedConfig

from ember.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

UNVERIFIED_ENV = "EMBER_ALLOW_UNVERIFIED_ARCHITECTURES"

# What ember lacks, by feature; each refusal below names one.
RECURRENT = (
    "linear-attention or state-space layers (Mamba, Mamba2, Gated DeltaNet, short "
    "convolutions, RWKV, xLSTM) whose per-request recurrent state ember does not carry"
)
MLA = "multi-head latent attention, whose compressed K/V latent ember's paged cache does not hold"
SPARSE = (
    "indexed or compressed sparse attention (a lightning indexer choosing the keys) that "
    "ember's attention op does not run"
)
NOT_ROUTED = (
    "attention that does not go through transformers' attention interface, so ember cannot "
    "route it to its paged cache"
)
KWARGS_DROPPED = (
    "decoder layers that do not pass the attention keyword arguments through to the "
    "attention call, so ember's per-step metadata never reaches it"
)
FUSED_QKV = (
    "a fused QKV projection split per head inside the attention module, whose K/V rows ember's "
    "cache does not receive in [heads, head_dim] form"
)
ABSOLUTE_POSITIONS = (
    "encoder-style learned absolute positions computed from the batch shape (a BERT-family "
    "model used as a decoder), which ember's flattened multi-sequence batches do not give"
)
DIFFERENTIAL = "differential attention (two softmax maps subtracted per head)"
DYNAMIC_MASK = "a learned dynamic attention mask added inside attention (Doge)"

VISION_ONLY_INPUT = "an image-conditioned LM whose image features ember does not feed"
AUDIO_CODEBOOKS = "an audio LM (Moshi's per-codebook linears and depth decoder)"
MIXTURE_OF_ATTENTION = (
    "mixture-of-attention-heads (JetMoE), whose K/V ember's cache does not receive one row per head"
)
MULTI_QUERY_FUSED = (
    "GPTBigCode's fused multi-query c_attn, whose K/V reach the attention call in a layout "
    "ember's cache does not take"
)
RECURSIVE = "recurrent reasoning cycles (HRM) that rerun layers over their own outputs"

# model_types whose attention calls pass a learned per-head sink logit (`s_aux`), applied by
# `ember::sink_scale` after the paged op.
ATTENTION_SINKS = frozenset({"gpt_oss", "granite_swa", "granitemoe_swa", "flint", "mimo_v2_flash"})

# model_type -> the missing feature, for those ember refuses with a reason of its own (the
# rest are refused by `ember.model.spec.model_task` or as not checked).
REFUSED: dict[str, str] = {
    **dict.fromkeys(
        (
            "bailing_hybrid", "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid",
            "inkling2_text", "inkling_text", "jamba", "kimi_linear", "lfm2", "lfm2_moe", "lfm3",
            "mamba", "mamba2", "minimax", "nemotron_h", "olmo_hybrid", "qwen3_5", "qwen3_5_moe",
            "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "recurrent_gemma", "rwkv",
            "xlstm", "zamba", "zamba2", "zaya",
        ),
        RECURRENT,
    ),
    **dict.fromkeys(
        ("deepseek_v32", "deepseek_v4", "glm_moe_dsa", "hy_v4", "qwen4_exp", "qwen4_exp_text"),
        SPARSE,
    ),
    **dict.fromkeys(
        (
            "axk1", "axk2", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash",
            "minicpm3", "youtu",
        ),
        MLA,
    ),
    **dict.fromkeys(
        (
            "bert", "camembert", "data2vec-text", "electra", "ernie", "roberta", "roc_bert",
            "xlm-roberta",
        ),
        ABSOLUTE_POSITIONS,
    ),
    **dict.fromkeys(("stablelm", "nemotron"), KWARGS_DROPPED),
    "diffllama": DIFFERENTIAL,
    "doge": DYNAMIC_MASK,
    "gpt_bigcode": MULTI_QUERY_FUSED,
    "jetmoe": MIXTURE_OF_ATTENTION,
    "git": VISION_ONLY_INPUT,
    "moshi": AUDIO_CODEBOOKS,
    "hrm_text": RECURSIVE,
}  # fmt: skip

# model_types that decode token-identically to HF: tests/architectures builds each and
# compares; mllama (images through cross-attention) is checked by tests/e2e/test_mllama.py.
EXACT: frozenset[str] = frozenset(
    {
        "afmoe", "apertus", "arcee", "aria_text", "beam", "bert-generation", "biogpt", "bitnet",
        "cohere", "cohere2", "cohere2_moe", "ctrl", "cwm", "dots1", "ernie4_5", "ernie4_5_moe",
        "exaone4", "exaone_moe", "flex_olmo", "flint", "fuyu", "gemma", "gemma2", "gemma3",
        "gemma3_text", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "glm", "glm4",
        "glm4_moe", "got_ocr2", "gpt-sw3", "gpt2", "gpt_neox", "gpt_oss", "granite", "granite_swa",
        "granitemoe", "granitemoe_swa", "granitemoeshared", "helium", "hunyuan_v1_dense",
        "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2", "kolibri1",
        "laguna", "llama", "llama4", "llama4_text", "mellum", "mimo_v2_flash", "minimax_m2",
        "minimax_m3_vl_text", "ministral", "ministral3", "mistral", "mixtral", "mllama",
        "modernbert-decoder", "moss_transcribe_diarize", "nanochat", "olmo", "olmo2", "olmo3",
        "olmoe", "opt", "persimmon", "phi", "phi3", "phi4_multimodal", "phimoe", "qwen2",
        "qwen2_moe", "qwen3", "qwen3_moe", "roberta-prelayernorm", "seed_oss", "smollm3",
        "solar_open", "starcoder2", "vaultgemma", "xlm-roberta-xl",
    }
)  # fmt: skip

# Attention layer kinds ember's op runs exactly (transformers' `layer_types` values).
_EXACT_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
_SPARSE_LAYER_TYPES = frozenset(
    {
        "indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
        "minimax_m3_sparse",
    }
)  # fmt: skip


def check_architecture(config: PretrainedConfig) -> None:
    """Raise `UnsupportedModelError` naming the missing feature unless ember runs `config`'s
    causal LM exactly (see the module docstring)."""
    refuse_known(config)
    require_checked(config)


def refuse_known(config: PretrainedConfig) -> None:
    """The refusals with a reason of their own: the table, and layer kinds ember lacks."""
    model_type = config.model_type
    arch = _arch(config)
    if model_type in REFUSED:
        raise UnsupportedModelError(
            f"architecture {arch!r} (model_type {model_type!r}) is not supported: it has "
            f"{REFUSED[model_type]}, which ember does not run exactly"
        )
    for text in {id(c): c for c in (config, config.get_text_config())}.values():
        kinds = set(_per_layer_kinds(text)) - _EXACT_LAYER_TYPES
        if kinds:
            feature = SPARSE if kinds <= _SPARSE_LAYER_TYPES else RECURRENT
            raise UnsupportedModelError(
                f"architecture {arch!r} has layers of kind {sorted(kinds)}: {feature}, which "
                "ember does not run exactly"
            )


def require_checked(config: PretrainedConfig) -> None:
    """Refuse a model_type not in `EXACT` (it may decode wrong tokens), unless the user opts
    in with UNVERIFIED_ENV."""
    model_type = config.model_type
    arch = _arch(config)
    if model_type in EXACT:
        return
    if os.environ.get(UNVERIFIED_ENV) == "1":
        logger.warning(
            "architecture %r (model_type %r) has not been checked against HF by ember; "
            "loading it because %s=1: compare its output with transformers yourself",
            arch, model_type, UNVERIFIED_ENV,
        )  # fmt: skip
        return
    raise UnsupportedModelError(
        f"architecture {arch!r} (model_type {model_type!r}) has not been checked against HF by "
        f"ember, so it may decode wrong tokens; set {UNVERIFIED_ENV}=1 to load it anyway"
    )


def _arch(config: PretrainedConfig) -> str:
    return (getattr(config, "architectures", None) or [config.model_type])[0]


def _per_layer_kinds(config: PretrainedConfig) -> list[str]:
    """The config's `layer_types` (transformers' per-layer attention kinds), [] when it has
    none."""
    try:
        kinds = getattr(config, "layer_types", None)
    except RuntimeError:  # a per-layer field of a heterogeneous config
        kinds = config.to_dict().get("layer_types")
    return [k for k in kinds or [] if isinstance(k, str)]
