"""A GGUF file's transformers config and tokenizer, through transformers' own GGUF support, with
the file's parsed reader shared and cached as pickles (`ember.model.gguf.cache`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from ember.errors import UnsupportedModelError
from ember.model.gguf.cache import _cache_entry, _load_pickle, _save_pickle
from ember.model.gguf.reader import _architecture, _reader

logger = logging.getLogger("ember")


@contextlib.contextmanager
def _shared_reader(path: str) -> Iterator[None]:
    """transformers' GGUF code opens the file itself (`gguf.GGUFReader(path)`): hand it the
    reader already parsed."""
    import gguf

    shared, original, key = _reader(path), gguf.GGUFReader, os.path.abspath(path)

    def reader(p: Any, *args: Any, **kwargs: Any) -> Any:
        return shared if os.path.abspath(p) == key else original(p, *args, **kwargs)

    gguf.GGUFReader = reader
    try:
        with _fast_value_parser():
            yield
    finally:
        gguf.GGUFReader = original


_GGUF_INTS, _GGUF_FLOATS, _GGUF_STRING, _GGUF_ARRAY = (0, 1, 2, 3, 4, 5, 10, 11), (6, 12), 8, 9


@contextlib.contextmanager
def _fast_value_parser() -> Iterator[None]:
    """transformers parses every metadata value through `_gguf_parse_value`, which decodes a
    string by way of a list of its byte values: 1.4 s for Gemma 3's 262k-token vocabulary.
    Strings and plain numbers (alone or in arrays) are parsed directly, to the same values;
    everything else goes to transformers' own parser. Left alone where transformers has no
    such function."""
    from transformers import modeling_gguf_pytorch_utils as utils

    original = getattr(utils, "_gguf_parse_value", None)
    if original is None:
        yield
        return

    def parse(value: Any, data_type: Any) -> Any:
        types = data_type if isinstance(data_type, list) else [data_type]
        if len(types) == 1 or (len(types) == 2 and types[0] == _GGUF_ARRAY):
            item = types[-1]
            if item == _GGUF_STRING:
                return bytes(value).decode()
            if item in _GGUF_INTS:
                return int(value[0])
            if item in _GGUF_FLOATS:
                return float(value[0])
        return original(value, data_type)

    utils._gguf_parse_value = parse
    try:
        yield
    finally:
        utils._gguf_parse_value = original


@contextlib.contextmanager
def _name_maps_built_once() -> Iterator[None]:
    """transformers' `get_gguf_hf_weights_map` recurses over the model's modules and builds
    gguf's `TensorNameMap` afresh in each call (313 times, 1.6 s, for Gemma 3 270M); it only
    reads the map, so one per (architecture, layers) serves them all."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def load_gguf_config(path: str) -> PretrainedConfig:
    """The transformers config of a GGUF file (metadata only; tensors are not read). Cached as
    the tokenizer is (`load_gguf_tokenizer`); when both are, the file is opened with a light
    reader, which skips the vocabulary."""
    entry = _cache_entry(path, "config")
    config = _load_pickle(entry, "config")
    if config is not None:
        tokenizer_entry = _cache_entry(path, "tokenizer")
        light = tokenizer_entry is not None and os.path.isfile(tokenizer_entry)
        _architecture(_reader(path, light=light), path)
        return config
    _architecture(_reader(path), path)
    directory, name = os.path.split(os.path.abspath(path))
    try:
        with _shared_reader(path):
            config = AutoConfig.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise UnsupportedModelError(f"cannot read the config of GGUF file {path!r}: {e}") from e
    _save_pickle(config, entry)
    return config


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The file's tokenizer and chat template through transformers' GGUF converter, or None
    (logged) when it has none that transformers can build.

    The converted tokenizer is pickled into the user cache (a private directory, as the
    compile cache), keyed by the file's path, size and mtime and the transformers/tokenizers
    versions, and later loads unpickle it: for a 262k-token vocabulary (Gemma 3) converting
    takes about 5 s, `from_pretrained` of a saved copy 2.7 s, unpickling 1.1 s."""
    entry = _cache_entry(path, "tokenizer")
    tokenizer = _load_pickle(entry, "tokenizer")
    if tokenizer is not None:
        return tokenizer
    directory, name = os.path.split(os.path.abspath(path))
    try:
        with _shared_reader(path):
            tokenizer = AutoTokenizer.from_pretrained(
                directory, gguf_file=name, local_files_only=True
            )
    except (OSError, ValueError, TypeError, KeyError) as e:
        logger.warning("no tokenizer in %s (%s); only token-id prompts work", path, e)
        return None
    _save_pickle(tokenizer, entry)
    return tokenizer
