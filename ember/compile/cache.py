"""Compile-cache directory: layout, key, lookup and eviction. Used by `ember warmup` and the
engine.

Layout: `<cache_dir>/<key>/graphs/<forward>-<graph>.bin` is one compiled graph of that engine
shape (`CompiledForward`: Dynamo's bytecode and the inductor graph, loaded without tracing),
`<cache_dir>/<key>/inductor/` the inductor cache the graphs were built in (their compiled C++
kernels), and `<cache_dir>/<key>/key.json` holds the readable parts of the key (plus the
vector-ISA probes that passed in the build, `VEC_ISA_RECORD`), written once every graph is
saved. The key covers everything the
graphs depend on: model config, the rewritten model's structure (module types, tensor names,
shapes and dtypes), dtype, weight quantization, token-bucket ladder, block size,
inductor settings, torch version, CPU ISA, the exact -march=native target, ember's version and a
hash of ember's own source files (what a graph traces through, its ops included, changes with
them even where the version does not).
The engine uses a cache dir only if it is private (`ember.host.private_dir`: created 0700,
owned by this user, writable by nobody else), since it loads pickled code from it. KV-cache
size and max_model_len are dynamic graph dims, so they are not part of the key.

Why a whole inductor cache dir rather than `torch.compiler.save_cache_artifacts()`: measured on
the tiny Llama, loading the portable artefacts into a fresh process still took 32.5 s of a 40 s
cold warm-up, because the artefacts carry kernel sources and every C++ kernel was rebuilt with
g++ on load. The directory keeps the built kernels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import torch

from ember.host.dirs import default_compile_cache_dir, prune_cache, touch
from ember.host.isa import cpu_target
from ember.keys import entry_dir, sources_fingerprint
from ember.model.loader import LoadedModel
from ember.version import __version__

logger = logging.getLogger("ember")

KEY_FILE = "key.json"


def key_parts(
    loaded: LoadedModel,
    buckets: tuple[int, ...],
    block_size: int,
    freezing: bool,
    dynamic_graph: bool,
    kv_dtype: torch.dtype,
    regions: bool = False,
) -> dict[str, Any]:
    """The key of the graphs of `loaded` (as the loader built it: dtype, quantization, attention
    backend, LoRA slots) run with this bucket ladder, block size, KV cache dtype and inductor
    settings, whole-model or by regions (`ember.compile.regions`)."""
    hf_config = loaded.spec.hf_config
    lora = loaded.lora
    model = json.loads(hf_config.to_json_string(use_diff=False))
    for volatile in ("_name_or_path", "transformers_version", "_attn_implementation_autoset"):
        model.pop(volatile, None)
    return {
        "model_config_sha256": hashlib.sha256(
            json.dumps(model, sort_keys=True).encode()
        ).hexdigest(),
        "modules_sha256": modules_fingerprint(loaded.model),
        "architecture": (getattr(hf_config, "architectures", None) or ["?"])[0],
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "weight_dtype": str(loaded.weight_dtype).removeprefix("torch."),
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "buckets": list(buckets),
        "dynamic_graph": dynamic_graph,
        "block_size": block_size,
        "freezing": freezing,
        "regions": regions,
        "attention_backend": loaded.attention_backend,
        "lora": [lora.max_loras, lora.max_rank] if lora else None,
        "quantization": loaded.quantization,
        "torch": torch.__version__,
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        # inductor builds its C++ kernels with -march=native: the exact target, not the ISA
        "cpu_target": cpu_target(),
        "kernels_isa": loaded.cpu_isa,
        "ember": __version__,
        "ember_sources_sha256": sources_fingerprint(),
        "graphs": "aot_compile, no asserts",
        "linears": "packed panels, bf16 pairs",
    }


def modules_fingerprint(model: torch.nn.Module) -> str:
    """Hash of the model as the loader rewrote it: every module's type and every parameter's
    and buffer's name, shape and dtype. A graph compiled for one structure (GEMV or packed
    linears, a packed tied head, LoRA slots) is never loaded for another, whatever else the
    key says."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        h.update(f"{name}:{type(module).__qualname__};".encode())
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, t in tensors:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()


def inductor_dir(cache_dir: str, parts: dict[str, Any]) -> str:
    return os.path.join(entry_dir(cache_dir, parts), "inductor")


def graph_file(cache_dir: str, parts: dict[str, Any], name: str) -> str:
    return os.path.join(entry_dir(cache_dir, parts), "graphs", f"{name}.bin")


def lookup(cache_dir: str, parts: dict[str, Any]) -> dict[str, Any] | None:
    """The record of the complete entry for `parts` (its key.json: the key, plus what
    `mark_complete` recorded), marked as just used; else None, after logging one line saying
    why not (the start is slow then: it compiles)."""
    entry = entry_dir(cache_dir, parts)
    try:
        with open(os.path.join(entry, KEY_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict):
        touch(entry)
        return record
    logger.warning(
        "compile cache %s has no entry for this engine (%s); compiling",
        cache_dir,
        _describe_mismatch(cache_dir, parts),
    )
    return None


# What the default compile cache keeps, least recently used entries first out (entries of
# the test and benchmark models measured 7-12 MB).
COMPILE_CACHE_MAX_BYTES = 2 << 30


# What `mark_complete` records with an entry besides its key: the vector-ISA test libraries
# (in the entry's inductor dir) that loaded in the probes of the process that built it
# (`ember.compile.inductor.vec_isa_probes`).
VEC_ISA_RECORD = "recorded_vec_isa_probes"


def recorded_probes(record: dict[str, Any] | None) -> list[str]:
    """The vector-ISA probes an entry's record (`lookup`) holds (none for a miss, an entry
    written without them, or a record not in this form)."""
    probes = record.get(VEC_ISA_RECORD) if record is not None else None
    return [p for p in probes if isinstance(p, str)] if isinstance(probes, list) else []


def mark_complete(
    cache_dir: str, parts: dict[str, Any], vec_isa_probes: list[str] | None = None
) -> str:
    """Mark the entry of `parts` complete (every graph saved), recording `vec_isa_probes` (see
    `VEC_ISA_RECORD`) with its key. In the default cache dir, the
    least recently used entries then go while it holds over `COMPILE_CACHE_MAX_BYTES`: its
    key changes with ember's and torch's versions, so entries only a past version could load
    would pile up. A dir given explicitly is left as it is."""
    entry = entry_dir(cache_dir, parts)
    os.makedirs(entry, exist_ok=True)
    record = dict(parts)
    if vec_isa_probes:
        record[VEC_ISA_RECORD] = sorted(vec_isa_probes)
    with open(os.path.join(entry, KEY_FILE), "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    if _is_default(cache_dir):
        prune_cache(cache_dir, COMPILE_CACHE_MAX_BYTES, keep=entry)
    return entry


def _is_default(cache_dir: str) -> bool:
    return os.path.realpath(cache_dir) == os.path.realpath(default_compile_cache_dir())


def _describe_mismatch(cache_dir: str, parts: dict[str, Any]) -> str:
    """The entry closest to `parts` (fewest differing key parts) and what differs, in a line
    that stays short however many entries the cache holds."""
    diffs: list[tuple[int, str, list[str]]] = []
    for entry in sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else []:
        try:
            with open(os.path.join(cache_dir, entry, KEY_FILE)) as f:
                other = json.load(f)
        except (OSError, ValueError):
            continue
        differ = [k for k in parts if other.get(k) != parts[k]]
        diffs.append((len(differ), entry, differ))
    if not diffs:
        return "no entries yet"
    _, entry, differ = min(diffs)
    others = f" ({len(diffs) - 1} other entries differ more)" if len(diffs) > 1 else ""
    return f"closest entry {entry} differs in {', '.join(differ) or 'nothing'}{others}"
