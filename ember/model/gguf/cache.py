"""The user cache of what is converted from a GGUF file (config, tokenizer, tensor index): entry
paths keyed by the file's identity and library versions, pickling and pruning."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import tempfile
from typing import Any

from ember.host.dirs import private_dir, prune_cache, touch, user_cache_dir
from ember.keys import file_identity

logger = logging.getLogger("ember")


# The converted configs and tokenizers kept (least recently used first out): a Gemma 3
# tokenizer pickles to 14 MB.
GGUF_CACHE_MAX_BYTES = 512 << 20


# Changes when what ember writes there changes (2: tokenizers with "a b" merges, indexes; 3:
# indexes pickle `TensorType` from `ember.model.gguf.reader`; 4: from `ember.model.gguf.index`,
# configs and tokenizers built from ember's own parse).
_CACHE_LAYOUT = 4


def _cache_entry(path: str, what: str) -> str | None:
    """Where ember keeps `what` ("config", "tokenizer", "index") converted from the GGUF file
    `path`: `~/.cache/ember/gguf/<key>-<what>.pkl`, the key from the file's real path, size
    and mtime, the transformers/tokenizers versions and `_CACHE_LAYOUT`. None: no usable cache
    directory, or no file."""
    import tokenizers
    import transformers

    file = file_identity(path)
    if file is None:  # missing: `_open` names the problem
        return None
    real, size, mtime = file
    ident = f"{real}\0{size}\0{mtime}"
    ident += f"\0{transformers.__version__}\0{tokenizers.__version__}\0{_CACHE_LAYOUT}"
    parent = private_dir(user_cache_dir("gguf"), "GGUF cache")
    if parent is None:
        return None
    return os.path.join(parent, f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}-{what}.pkl")


def _load_pickle(entry: str | None, what: str) -> Any:
    """The object cached at `entry`, or None (missing; unreadable: logged, converted again)."""
    if entry is None or not os.path.isfile(entry):
        return None
    try:
        with open(entry, "rb") as f:
            obj = pickle.load(f)
    except Exception as e:  # noqa: BLE001  (any unpickling failure: convert again)
        logger.warning("converting the %s again: cannot read %s (%s)", what, entry, e)
        return None
    touch(entry)
    return obj


class _Pickler(pickle.Pickler):
    """Pickles a `tokenizers.Tokenizer` as its JSON (as the Tokenizer does itself) with a BPE
    model's merges in the "a b" form, which `Tokenizer.from_str` reads faster than pairs: Gemma
    3's 515k merges unpickle in 1.5-1.7 s instead of 1.9-2.1 (the same tokenizer: `to_str`
    gives back the same JSON). Kept as pairs where a merged token has a space in it."""

    def reducer_override(self, obj: Any) -> Any:
        import tokenizers

        if type(obj) is not tokenizers.Tokenizer:
            return NotImplemented
        state = json.loads(obj.to_str())
        model = state.get("model") or {}
        merges = model.get("merges")
        if model.get("type") == "BPE" and merges and all(_joinable(m) for m in merges):
            model["merges"] = [" ".join(m) for m in merges]
        return tokenizers.Tokenizer.from_str, (json.dumps(state, ensure_ascii=False),)


def _joinable(merge: Any) -> bool:
    return (
        isinstance(merge, list)
        and len(merge) == 2
        and all(isinstance(part, str) and part and " " not in part for part in merge)
    )


def _save_pickle(obj: Any, entry: str | None) -> None:
    """Pickle into a fresh file beside `entry`, then rename it: a reader never sees a
    half-written one."""
    if entry is None:
        return
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(entry))
    try:
        with os.fdopen(fd, "wb") as f:
            _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        os.replace(tmp, entry)
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
        logger.debug("not cached in %s: %s", entry, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return
    prune_cache(os.path.dirname(entry), GGUF_CACHE_MAX_BYTES, keep=entry)
