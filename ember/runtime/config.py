"""Engine settings: `EngineArgs`, the one user-facing argument layer (vLLM's EngineArgs), with
each default stated once, resolved against the checkpoint into the frozen `EngineConfig`.

`LLM(...)` takes `EngineArgs`' fields as keywords and the CLI derives its flags from them
(`add_cli_args` / `from_cli_args`). "auto" values (dtype, attention backend, max_model_len) are
resolved in `EngineArgs.create_engine_config`; nothing patches a config afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ember import kernels
from ember.attention import BACKEND_NAMES, BackendUnavailableError, select_backend
from ember.attention.ops import kv_row_width
from ember.host.dirs import default_compile_cache_dir
from ember.host.isa import CPU_ISAS, check_host_isa, resolve_isa
from ember.model.gguf.reader import has_quantized_weights
from ember.model.layers.rewrite import QUANTIZATIONS
from ember.model.spec import (
    LOAD_FORMATS,
    POOLED_TASKS,
    ModelSpec,
    check_weights_format,
    read_model_spec,
    resolve_model,
)
from ember.runtime.dtypes import (
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    compute_dtype,
    quantized_dtypes,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from ember.runtime.pooling import max_seq_length
from ember.runtime.speculative import SpeculativeConfig


def _help(text: str, **extra: Any) -> Any:
    """Field metadata: the CLI help (and choices) of an `EngineArgs` field."""
    return {"help": text, **extra}


@dataclass
class EngineArgs:
    """Every engine knob a user sets, with its default (vLLM meaning where vLLM has the knob).

    `model` is a local HF checkpoint directory, a GGUF file (`*.gguf`) or a hub id. See
    `create_engine_config` for validation: bad values raise `ValueError` naming the knob and
    the range.
    """

    model: str
    dtype: str | torch.dtype = field(
        default="auto",
        metadata=_help(
            "linear weights: auto = a 16-bit checkpoint's in bfloat16, an fp32 one's in "
            "float32 (the math is bfloat16 only where the CPU has native bf16 math, else "
            "float32); float16 is cast to bfloat16; int8 = quantization=int8 (per-channel "
            "scales) with float32 math",
            choices=DTYPE_CHOICES,
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=_help(
            "quantization of every linear layer's weights (activations in float32, quantized "
            "to int8 per group of 32 for the products: see quantize_activations): int8 = one "
            "scale per output channel, int4 = groups of 32 with a scale and offset each",
            choices=QUANTIZATIONS,
        ),
    )
    quantize_activations: bool = field(
        default=True,
        metadata=_help(
            "quantized linears quantize their input to int8 per group of 32 and multiply in "
            "integers (llama.cpp's and OpenVINO's scheme); off: float32 activations, for "
            "quantization=int8 only (the group-quantized int4 and GGUF linears always quantize)"
        ),
    )
    kv_cache_dtype: str | torch.dtype = field(
        default="auto",
        metadata=_help(
            "dtype of the KV cache: auto = int8 where the linear weights are quantized (a "
            "quantized GGUF file, quantization=...), else the dtype the weights are kept in "
            "(bfloat16 for a 16-bit checkpoint under dtype=auto, also where the math is "
            "float32; an encoder-only model's: the math's); float32; bfloat16 (bfloat16 "
            "activations need a bfloat16 or int8 cache); int8 (a scale per token and K/V "
            "head: half of bfloat16's bytes; the torch backend only)",
            choices=KV_CACHE_DTYPE_CHOICES,
        ),
    )
    kv_cache_gib: float = field(default=4.0, metadata=_help("KV cache size, GiB"))
    block_size: int = field(default=16, metadata=_help("KV block size in tokens (power of 2)"))
    max_num_seqs: int = field(default=128, metadata=_help("sequences per step"))
    max_num_batched_tokens: int = field(default=2048, metadata=_help("tokens per step"))
    max_model_len: int | None = field(
        default=None, metadata=_help("prompt + output tokens (default: the model's limit)")
    )
    seed: int = field(default=0, metadata=_help("seed of the engine's sampling RNG"))
    compile: bool = field(
        default=True, metadata=_help("compile every shape bucket with torch.compile first")
    )
    compile_cache_dir: str | None = field(
        default="auto",
        metadata=_help(
            "load/save compiled graphs here (see `ember warmup`); auto = "
            "$XDG_CACHE_HOME/ember/compile unless EMBER_DISABLE_COMPILE_CACHE=1 or "
            "freeze_weights; '' (None in Python) = no cache"
        ),
    )
    freeze_weights: bool = field(
        default=False,
        metadata=_help("let inductor fold and prepack weights (faster GEMMs; not cacheable)"),
    )
    prefix_cache_dir: str | None = field(
        default=None,
        metadata=_help(
            "keep the prefix cache's full KV blocks in this directory too (created 0700), so a "
            "restarted engine, another worker or `ember generate` on the same model and "
            "settings reads a known prompt prefix back instead of computing it; default: off"
        ),
    )
    prefix_cache_gib: float = field(
        default=16.0,
        metadata=_help(
            "size cap of prefix_cache_dir, GiB: past it the least recently used blocks go"
        ),
    )
    background_compile: bool = field(
        default=False,
        metadata=_help(
            "answer at once: steps run eagerly while the graphs compile in forked workers, "
            "each switched in between steps when ready (graphs in the compile cache load first)"
        ),
    )
    regional_compile: bool | None = field(
        default=None,
        metadata=_help(
            "compile each distinct decoder layer once and reuse it for every layer of its kind "
            "(cold compiles that do not grow with depth); default: models of "
            "8 layers and more"
        ),
    )
    token_buckets: tuple[int, ...] = field(
        default=(1,),
        metadata=_help("comma-separated token counts with their own static graph"),
    )
    max_logprobs: int = field(default=20, metadata=_help("largest SamplingParams.logprobs"))
    attention_backend: str = field(
        default="auto",
        metadata=_help(
            "paged-attention backend (auto: the fastest usable here)", choices=BACKEND_NAMES
        ),
    )
    enable_lora: bool = field(default=False, metadata=_help("serve LoRA adapters"))
    max_loras: int = field(default=4, metadata=_help("adapters resident in one step"))
    max_lora_rank: int = field(default=16, metadata=_help("largest adapter rank"))
    cpu_isa: str = field(
        default="native",
        metadata=_help(
            "ISA of ember's own kernels and its native-bf16 decision: native, or avx2 to take "
            "the AVX2 paths on an AVX-512 machine (one ISA per process; EMBER_CPU_ISA=avx2 in "
            "the environment makes the whole process an AVX2-only host, ATen included)",
            choices=CPU_ISAS,
        ),
    )
    load_format: str = field(
        default="safetensors",
        metadata=_help(
            "weights to load: safetensors only, or auto = safetensors, else a PyTorch .bin "
            "checkpoint (a pickle, read with torch.load(weights_only=True))",
            choices=LOAD_FORMATS,
        ),
    )

    limit_mm_per_prompt: dict[str, int] | None = field(
        default=None,
        metadata=_help(
            'most multimodal items per prompt, as JSON (vision-language models): {"image": N};'
            ' default {"image": 4}'
        ),
    )
    revision: str | None = field(
        default=None,
        metadata=_help("hub revision (branch, tag or commit) when model is a hub id"),
    )
    speculative_config: dict[str, Any] | str | None = field(
        default=None,
        metadata=_help(
            'speculative decoding, as JSON (vLLM\'s keys): {"method": "ngram", '
            '"num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m} '
            '(prompt lookup) or {"method": "draft_model", "model": PATH, '
            '"num_speculative_tokens": k}'
        ),
    )
    generation_config: str = field(
        default="auto",
        metadata=_help(
            "default SamplingParams of generate() without any: auto = the model's generation "
            "config (its temperature, top_p, top_k, min_p, repetition_penalty, "
            "max_new_tokens), vllm = SamplingParams' own defaults, or a directory with a "
            "generation_config.json (EOS ids always come from the model's)"
        ),
    )

    def create_engine_config(self) -> EngineConfig:
        """Read the checkpoint's config once, resolve "auto" values against it and the CPU,
        and build the frozen, validated config."""
        if isinstance(self.model, os.PathLike):  # a pathlib.Path, as HF's from_pretrained takes
            return dataclasses.replace(self, model=os.fspath(self.model)).create_engine_config()
        model = resolve_model(self.model, self.revision, self.load_format)
        if model != self.model:  # a hub id: every later read is of the local snapshot
            return dataclasses.replace(self, model=model, revision=None).create_engine_config()
        check_host_isa()
        if self.cpu_isa not in CPU_ISAS:
            raise ValueError(f"cpu_isa must be one of {CPU_ISAS}, got {self.cpu_isa!r}")
        cpu_isa = resolve_isa(self.cpu_isa)  # "native" on a host forced to AVX2 is "avx2"
        conflict = kernels.isa_conflict(cpu_isa)
        if conflict is not None:
            raise ValueError(conflict)
        kernels.prebuild(cpu_isa)  # a first build overlaps reading the checkpoint
        spec = read_model_spec(self.model)
        if spec.gguf_file is not None and self.enable_lora:
            raise ValueError("enable_lora=True is not supported with a GGUF model")
        dtype, quantization = quantized_dtypes(self.dtype, self.quantization, spec.gguf_file)
        max_model_len = self._max_model_len(spec)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        check_weights_format(self.model, self.load_format)
        gc = self.generation_config
        if not isinstance(gc, str) or (gc not in ("auto", "vllm") and not os.path.isdir(gc)):
            raise ValueError(f"generation_config must be auto, vllm or a directory, got {gc!r}")
        weight_dtype = resolve_dtype(dtype, spec.checkpoint_dtype)
        run_dtype = compute_dtype(weight_dtype, cpu_isa)
        kv_dtype, backend = self._kv_cache(spec, quantization, weight_dtype, run_dtype)
        buckets = tuple(b for b in self.token_buckets if b <= self.max_num_batched_tokens)
        limit_mm = _limit_mm(self.limit_mm_per_prompt, spec)
        speculative = SpeculativeConfig.parse(self.speculative_config)
        return EngineConfig(
            model=self.model,
            model_spec=spec,
            dtype=run_dtype,
            weight_dtype=weight_dtype,
            kv_dtype=kv_dtype,
            quantization=quantization,
            quantize_activations=self.quantize_activations,
            cpu_isa=cpu_isa,
            kv_cache_gib=self.kv_cache_gib,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            seed=self.seed,
            compile=self.compile and _can_compile(),
            background_compile=self.background_compile,
            regional_compile=self.regional_compile,
            compile_cache_dir=_compile_cache_dir(self.compile_cache_dir, self.freeze_weights),
            freeze_weights=self.freeze_weights,
            prefix_cache_dir=self.prefix_cache_dir or None,
            prefix_cache_gib=self.prefix_cache_gib,
            token_buckets=buckets or (1,),
            max_logprobs=self.max_logprobs,
            attention_backend=backend.name,
            enable_lora=self.enable_lora,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            load_format=self.load_format,
            generation_config=self.generation_config,
            limit_mm_per_prompt=limit_mm,
            speculative_config=speculative,
        )

    def _max_model_len(self, spec: ModelSpec) -> int:
        """`max_model_len`, checked against the model's positions (None: all of them)."""
        max_positions = spec.max_positions
        if spec.task in POOLED_TASKS:
            # sentence-transformers' own input limit, when it ships one (all-MiniLM-L6-v2: 256).
            max_positions = min(max_positions, max_seq_length(self.model) or max_positions)
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = max_positions
        elif isinstance(max_model_len, int) and max_model_len > max_positions:
            raise ValueError(
                f"max_model_len must be <= the model's max_position_embeddings={max_positions}, "
                f"got {max_model_len}"
            )
        return max_model_len

    def _kv_cache(
        self,
        spec: ModelSpec,
        quantization: str | None,
        weight_dtype: torch.dtype,
        run_dtype: torch.dtype,
    ) -> tuple[torch.dtype, Any]:
        """(the KV cache's dtype, the attention backend that serves it)."""
        # "auto": as narrow as the weights where steps decode, int8 where they are quantized
        # (`resolve_kv_cache_dtype` says why); an encoder-only model attends each input once,
        # so its cache is only a staging area: kept in the math's dtype.
        if spec.task in POOLED_TASKS:
            narrow = run_dtype
        elif quantization is not None or (
            spec.gguf_file is not None and has_quantized_weights(spec.gguf_file)
        ):
            narrow = torch.int8
        else:
            narrow = weight_dtype
        kv_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, narrow, run_dtype)
        try:
            backend = select_backend(
                self.attention_backend, spec.attention_features(kv_dtype, run_dtype)
            )
        except BackendUnavailableError:
            if self.kv_cache_dtype != "auto" or kv_dtype == run_dtype:
                raise
            kv_dtype = run_dtype  # "auto": a backend that needs the activations' dtype
            backend = select_backend(
                self.attention_backend, spec.attention_features(kv_dtype, run_dtype)
            )
        return kv_dtype, backend

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """One `--flag` per field (`--model` optional: the caller supplies a default)."""
        for f in dataclasses.fields(EngineArgs):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            kwargs: dict[str, Any] = {"help": f.metadata.get("help"), "default": f.default}
            if f.name == "model":
                kwargs.update(default=None, help="local HF checkpoint dir, GGUF file or hub id")
            elif f.default is True or f.default is False or f.name == "regional_compile":
                kwargs["action"] = argparse.BooleanOptionalAction
            elif f.name == "limit_mm_per_prompt":
                kwargs["type"] = json.loads
            elif f.name == "token_buckets":
                kwargs["type"] = lambda s: tuple(int(x) for x in s.split(","))
            elif isinstance(f.default, float):
                kwargs["type"] = float
            elif isinstance(f.default, int) or f.name == "max_model_len":
                kwargs["type"] = int
            if "choices" in f.metadata:
                kwargs["choices"] = list(f.metadata["choices"])
            parser.add_argument(flag, **kwargs)

    @staticmethod
    def from_cli_args(args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The `EngineArgs` of parsed `add_cli_args` flags, with `overrides` on top."""
        values = {
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(EngineArgs)
            if hasattr(args, f.name)
        }
        values.update(overrides)
        return EngineArgs(**values)


@functools.cache
def _can_compile() -> bool:
    """Whether graphs can compile here; without a C++ compiler (inductor builds C++ kernels)
    engines run eagerly, which is said once per process."""
    from ember.compile.inductor import cpp_compiler_missing

    why = cpp_compiler_missing()
    if why is not None:
        logging.getLogger("ember").warning(
            "compile=True needs a C++ compiler (%s); running eagerly", why
        )
    return why is None


def _compile_cache_dir(requested: str | None, freeze_weights: bool) -> str | None:
    """The compile cache an engine uses: `requested`, or for "auto" (the default, as vLLM
    caches by default) ember's own under the user cache dir, which keeps its most recently
    used entries (`ember.compile.cache.COMPILE_CACHE_MAX_BYTES`). None: no cache ("" or None;
    "auto" with frozen weights, which cannot be cached, or EMBER_DISABLE_COMPILE_CACHE=1)."""
    if requested != "auto":
        return requested or None
    if freeze_weights or os.environ.get("EMBER_DISABLE_COMPILE_CACHE", "0") not in ("", "0"):
        return None
    return default_compile_cache_dir()


# Images per prompt of a vision-language model unless `limit_mm_per_prompt` says otherwise
# (it sizes each step's cross block tables).
DEFAULT_IMAGES_PER_PROMPT = 4


def _limit_mm(limit: dict[str, int] | None, spec: ModelSpec) -> dict[str, int]:
    """The checked `limit_mm_per_prompt` ({} for a model that takes no images)."""
    if spec.multimodal is None:
        if limit:
            raise ValueError(
                f"limit_mm_per_prompt={limit!r}: model {spec.architecture!r} takes no "
                "multimodal inputs"
            )
        return {}
    limit = {"image": DEFAULT_IMAGES_PER_PROMPT} if limit is None else limit
    if not isinstance(limit, dict) or set(limit) - {"image"}:
        raise ValueError(
            f'limit_mm_per_prompt must be a dict like {{"image": 2}} (this model takes '
            f"images), got {limit!r}"
        )
    _check_int("limit_mm_per_prompt['image']", limit.get("image", 0), 0, 64)
    return dict(limit)


def _check_int(name: str, value: int, low: int, high: int) -> None:
    """An integer knob: a float (even 16.0) or a bool is rejected, not truncated."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    _check_range(name, value, low, high)


def _check_range(name: str, value: int | float, low: int | float, high: int | float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know, fixed for the engine's lifetime. Built by
    `EngineArgs.create_engine_config`; the fields mean what `EngineArgs`' fields say.

    Units: `kv_cache_gib` in GiB for all layers' K and V together; `block_size` in tokens;
    `max_model_len` in tokens (prompt + output of one request).
    """

    model: str
    model_spec: ModelSpec = field(compare=False, repr=False)
    dtype: torch.dtype  # activations and every parameter but the linear weights
    weight_dtype: torch.dtype  # linear weights (unless quantized)
    kv_dtype: torch.dtype  # the KV cache: `dtype`, or bfloat16 under float32 math
    # Weight-only quantization of every linear layer: None, "int4" (groups of 32) or "int8"
    # (per-output-channel scales); activations and math stay in `dtype`, which must be
    # float32 (the KV cache too unless kv_cache_dtype asks for bfloat16).
    quantization: str | None
    kv_cache_gib: float
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    seed: int
    compile: bool
    compile_cache_dir: str | None
    freeze_weights: bool
    token_buckets: tuple[int, ...]
    max_logprobs: int
    attention_backend: str  # resolved: never "auto"
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    cpu_isa: str
    load_format: str = "safetensors"
    generation_config: str = "auto"
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    background_compile: bool = False
    speculative_config: SpeculativeConfig | None = None
    regional_compile: bool | None = None  # None: by layer count (`ember.compile.regions`)
    # Quantized linears quantize their input to int8 (False: fp32 activations, int8 only).
    quantize_activations: bool = True
    prefix_cache_dir: str | None = None  # the prefix cache's disk tier (None: none)
    prefix_cache_gib: float = 16.0

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_compile()
        self._check_features()
        if self.attention_backend not in BACKEND_NAMES[1:]:
            raise ValueError(
                f"attention_backend must be one of {BACKEND_NAMES[1:]} once resolved, "
                f"got {self.attention_backend!r}"
            )

    def _check_sizes(self) -> None:
        _check_range("kv_cache_gib", self.kv_cache_gib, 1e-6, 1024)
        _check_range("prefix_cache_gib", self.prefix_cache_gib, 1e-6, 1 << 20)
        _check_int("block_size", self.block_size, 1, 1024)
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"block_size must be a power of two in [1, 1024], got {self.block_size}"
            )
        _check_int("max_num_seqs", self.max_num_seqs, 1, 4096)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 20)
        _check_int("max_model_len", self.max_model_len, 1, 1 << 24)
        _check_int("max_logprobs", self.max_logprobs, 0, 1 << 20)
        _check_int("seed", self.seed, 0, (1 << 63) - 1)
        if (
            any(isinstance(b, bool) or not isinstance(b, int) for b in self.token_buckets)
            or not self.token_buckets
            or list(self.token_buckets) != sorted(set(self.token_buckets))
            or self.token_buckets[0] < 1
            or self.token_buckets[-1] > self.max_num_batched_tokens
        ):
            raise ValueError(
                "token_buckets must be increasing sizes in [1, max_num_batched_tokens="
                f"{self.max_num_batched_tokens}], got {self.token_buckets}"
            )

    def _check_compile(self) -> None:
        if self.background_compile and (self.freeze_weights or not self.compile):
            raise ValueError(
                "background_compile=True needs compile=True and freeze_weights=False (frozen "
                "graphs compile in the engine's own process)"
            )
        if self.freeze_weights and self.compile_cache_dir is not None:
            raise ValueError(
                "freeze_weights=True cannot be combined with compile_cache_dir: inductor cannot "
                "cache graphs with frozen (prepacked) weights"
            )
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype}")
        if self.kv_dtype not in (self.dtype, torch.bfloat16, torch.int8):
            raise ValueError(
                f"kv_dtype must be bfloat16, int8 or the activations' {self.dtype}, "
                f"got {self.kv_dtype}"
            )

    def _check_features(self) -> None:
        """LoRA, quantization, images and speculation: each with what it runs with."""
        _check_int("max_loras", self.max_loras, 1, 64)
        _check_int("max_lora_rank", self.max_lora_rank, 1, 512)
        if self.enable_lora and self.task != "generate":
            raise ValueError(f"enable_lora=True needs a decoder-only LM; this model is {self.task}")
        if self.model_spec.multimodal is not None and (self.enable_lora or self.quantization):
            raise ValueError(
                f"{self.model_spec.architecture} (a vision-language model) runs without "
                "enable_lora and quantization"
            )
        if self.enable_lora and self.freeze_weights:
            raise ValueError(
                "enable_lora=True cannot be combined with freeze_weights=True: adapter slots "
                "change between steps and must not be folded into the graph"
            )
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(
                    f"quantization must be None or one of {QUANTIZATIONS}, "
                    f"got {self.quantization!r}"
                )
            quantized_dtypes(self.dtype, self.quantization, None)  # float32 math
            if self.enable_lora or self.task not in ("generate", "embed", "classify"):
                raise ValueError(
                    f"quantization={self.quantization!r} supports decoder-only LMs without "
                    "LoRA (enable_lora=False), embedding models and classifiers"
                )
        if not isinstance(self.quantize_activations, bool):
            raise ValueError(
                f"quantize_activations must be True or False, got {self.quantize_activations!r}"
            )
        if not self.quantize_activations and self.quantization != "int8":
            raise ValueError(
                "quantize_activations=False needs quantization='int8' (per-channel weights), "
                f"got quantization={self.quantization!r}"
                + (" and a GGUF file" if self.model_spec.gguf_file is not None else "")
                + ": the group-quantized linears (int4, GGUF files) always quantize activations"
            )
        if self.speculative_config is not None and self.task != "generate":
            raise ValueError(
                f"speculative_config needs a decoder-only LM; this model is {self.task}"
            )

    @property
    def task(self) -> str:
        """ "generate" (causal LM), "encdec" (encoder-decoder LM), "embed" (encoder-only
        model: `LLM.embed` and `LLM.score` only) or "classify" (a sequence classifier:
        `LLM.classify` and `LLM.score` only)."""
        return self.model_spec.task

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged KV cache, derived from the model and `EngineConfig.kv_cache_gib`."""

    layer_shapes: tuple[tuple[int, int], ...]  # (num_kv_heads, head_dim) of each layer's cache
    block_size: int
    num_blocks: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        rows = sum(h * kv_row_width(d, self.dtype) for h, d in self.layer_shapes)
        return 2 * self.block_size * elem * rows

    @staticmethod
    def num_blocks_for(
        kv_cache_gib: float,
        layer_shapes: tuple[tuple[int, int], ...],
        block_size: int,
        dtype: torch.dtype,
    ) -> int:
        """How many blocks of this geometry fit in `kv_cache_gib`."""
        one = KVCacheSpec(layer_shapes, block_size, 1, dtype)
        return int(kv_cache_gib * (1 << 30)) // one.bytes_per_block
