"""A GGUF file's transformers config and tokenizer, built from ember's parse of the file
(`reader.GGUFFile`) as transformers builds them for `from_pretrained(dir, gguf_file=name)`, with
its public mapping tables, config classes and tokenizer converter (nothing of transformers or
gguf is replaced), and cached as pickles (`ember.model.gguf.cache`).

Not followed, on purpose: a `tokenizer.json` or `tokenizer_config.json` beside the file, which
`AutoTokenizer.from_pretrained(dir, gguf_file=name)` reads from `dir`; ember's tokenizer comes
from the file alone."""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase

from ember.errors import UnsupportedModelError
from ember.model.gguf.cache import _cache_entry, _load_pickle, _save_pickle
from ember.model.gguf.reader import GGUFFile, _architecture, _reader

logger = logging.getLogger("ember")


def _transformers_value(value: Any) -> Any:
    """A metadata value as transformers' `load_gguf_checkpoint` reads it: an array of one
    item is that item."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


# GGUF MoE architectures -> transformers' model_type (as `load_gguf_checkpoint` renames them).
_MOE_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# Their expert widths, which transformers' mapping (5.23) omits: it leaves
# `moe_intermediate_size` (and Qwen2-MoE's shared expert's) at the config class's default,
# so a file of any other shape fails to load there. llama.cpp reads both.
_MOE_KEYS = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def gguf_config_dict(file: GGUFFile) -> dict[str, Any]:
    """The config dict transformers' `load_gguf_checkpoint(path)["config"]` gives for a file of
    one of ember's `ARCHITECTURES` (all of which it reads that way, by `GGUF_CONFIG_MAPPING`):
    "llama" files named "mistral" are Mistral's; the LM head is tied when the file has no
    `output.weight`; transformers' defaults for the architecture, over which each metadata
    key under the architecture's (or "general.") prefix that the mapping names is set, in
    file order; Gemma 3 is its text model; the vocabulary's length where no key gives the
    size (from a light parse too). Beyond transformers: MoE files' expert widths
    (`_MOE_KEYS`)."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = file.metadata["general.architecture"]
    named_mistral = file.metadata.get("general.name") == "mistral"  # the whole name, as there
    updated = "mistral" if "llama" in arch and named_mistral else _MOE_TYPES.get(arch, arch)
    config: dict[str, Any] = {
        "tie_word_embeddings": all(t.name != "output.weight" for t in file.tensors)
    }
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch))
    for key, value in (defaults or {}).items():
        config.setdefault(key, value)
    for key, value in file.metadata.items():
        prefix, _, name = key.replace(arch, updated).partition(".")
        value = _transformers_value(value)
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(name, -1)
        if prefix in _MOE_TYPES.values():
            renamed = _MOE_KEYS.get(name, renamed)
        if renamed not in (None, -1):
            config[renamed] = value
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"
    if "vocab_size" not in config:
        tokens = file.metadata.get("tokenizer.ggml.tokens")
        if tokens is not None:
            config["vocab_size"] = len(_transformers_value(tokens))
        elif "tokenizer.ggml.tokens" in file.skipped:
            config["vocab_size"] = file.skipped["tokenizer.ggml.tokens"]
    return config


def gguf_config(file: GGUFFile, directory: str) -> PretrainedConfig:
    """The transformers config `AutoConfig.from_pretrained(directory, gguf_file=...)` gives for
    `file` (its config class from the dict, named by the file's directory)."""
    config = gguf_config_dict(file)
    if config.get("model_type") == "mistral" and "layer_types" in config:
        config["model_type"] = "ministral"  # AutoConfig's rule for sliding-window layers
    return AutoConfig.for_model(**config, name_or_path=directory)


# The special tokens transformers' `get_gguf_tokenizer` names, and the keys of their ids.
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def gguf_tokenizer_dicts(file: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer_dict, tokenizer_config) as transformers' `get_gguf_tokenizer(path)` gives
    them: the metadata under `GGUF_TOKENIZER_MAPPING`'s names; BOS added by default for a
    sentencepiece ("llama") vocabulary, as llama.cpp does; the special tokens by their ids."""
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING

    metadata = file.metadata
    grouped = {
        group: {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return tokenizer, tokenizer_config


def _tokenizer_class(config: PretrainedConfig) -> type:
    """The class `AutoTokenizer` picks for a GGUF file of `config`'s type (no tokenizer files
    beside it): its registered one, else `TokenizersBackend` (so too for
    `MistralCommonBackend`, which needs mistral-common's files)."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    cls = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    return TokenizersBackend if cls.__name__ == "MistralCommonBackend" else cls


def gguf_tokenizer(
    file: GGUFFile, config: PretrainedConfig, directory: str
) -> PreTrainedTokenizerBase:
    """The tokenizer `AutoTokenizer.from_pretrained(directory, gguf_file=...)` gives for `file`
    (`config`: its config): transformers' `convert_gguf_tokenizer` of the file's vocabulary,
    wrapped in the class and with the arguments `from_pretrained` passes (what the file says
    of special tokens, BOS/EOS and the chat template over the class's defaults). The backend
    is handed over as `tokenizer_object`, which the class copies (1 s of Gemma 3's 262k-token
    vocabulary; reading the file again through transformers' own reader costs as much)."""
    from transformers.integrations.gguf import convert_gguf_tokenizer

    tokenizer_dict, tokenizer_config = gguf_tokenizer_dicts(file)
    backend, extra = convert_gguf_tokenizer(file.metadata["general.architecture"], tokenizer_dict)
    cls = _tokenizer_class(config)
    kwargs = {
        **dict.fromkeys(cls.vocab_files_names),  # from_pretrained's vocabulary files: none
        "name_or_path": directory,
        "is_local": True,
        "local_files_only": True,
        "added_tokens_decoder": {},
        **tokenizer_config,
        **extra,
    }
    return cls(tokenizer_object=backend, **kwargs)


def load_gguf_config(path: str) -> PretrainedConfig:
    """The transformers config of a GGUF file (metadata only; tensors are not read). Cached as
    the tokenizer is (`load_gguf_tokenizer`); when both are, the file is read light, without
    the vocabulary, or through ember's index of it."""
    entry = _cache_entry(path, "config")
    config = _load_pickle(entry, "config")
    if config is not None:
        tokenizer_entry = _cache_entry(path, "tokenizer")
        light = tokenizer_entry is not None and os.path.isfile(tokenizer_entry)
        _architecture(_reader(path, light=light), path)
        return config
    file = _reader(path)
    _architecture(file, path)
    assert isinstance(file, GGUFFile)  # a full parse, not an index
    try:
        config = gguf_config(file, os.path.dirname(os.path.abspath(path)))
    except (ValueError, KeyError, TypeError) as e:
        raise UnsupportedModelError(f"cannot read the config of GGUF file {path!r}: {e}") from e
    _save_pickle(config, entry)
    return config


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The file's tokenizer and chat template (`gguf_tokenizer`), or None (logged) when it has
    none that transformers can build.

    The converted tokenizer is pickled into the user cache (a private directory, as the
    compile cache), keyed by the file's path, size and mtime and the transformers/tokenizers
    versions, and later loads unpickle it: for a 262k-token vocabulary (Gemma 3) converting
    takes about 4 s, `from_pretrained` of a saved copy 2.7 s, unpickling 1.1 s."""
    entry = _cache_entry(path, "tokenizer")
    tokenizer = _load_pickle(entry, "tokenizer")
    if tokenizer is not None:
        return tokenizer
    file = _reader(path)
    _architecture(file, path)
    assert isinstance(file, GGUFFile)  # a full parse, not an index
    directory = os.path.dirname(os.path.abspath(path))
    try:
        tokenizer = gguf_tokenizer(file, gguf_config(file, directory), directory)
    except (OSError, ValueError, TypeError, KeyError, IndexError) as e:
        logger.warning("no tokenizer in %s (%s); only token-id prompts work", path, e)
        return None
    _save_pickle(tokenizer, entry)
    return tokenizer
