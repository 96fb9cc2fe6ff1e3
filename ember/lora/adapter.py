"""PEFT LoRA adapters on disk (`adapter_config.json` + `adapter_model.safetensors`, as written by
peft's `save_pretrained`), read with safetensors and checked against the base model."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

# The projections ember wraps; an adapter may target any subset of them.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's shape: a name, a positive integer id unique per adapter, and the adapter's dir."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive int, got {self.lora_int_id!r}")


class AdapterError(ValueError):
    """The adapter cannot be served with this base model or engine; the message says why."""


@dataclass(frozen=True)
class LoRAWeights:
    """Per wrapped module name: (A [rank, in], B [out, rank] with the scaling folded in)."""

    name: str
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter(
    request: LoRARequest, shapes: dict[str, tuple[int, int]], max_rank: int
) -> LoRAWeights:
    """Read and validate `request`'s adapter. `shapes`: wrapped module name -> (in, out).

    Raises AdapterError (a ValueError) naming the adapter and the mismatch (missing files,
    unsupported PEFT options, rank above `max_rank`, target modules or shapes that do not fit
    the base model), and for files that cannot be read or parsed (truncated safetensors, bad
    JSON, a config without a usable `r`), never another exception type.
    """
    try:
        return _load_adapter(request, shapes, max_rank)
    except AdapterError:
        raise
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        raise AdapterError(
            f"LoRA {request.lora_name!r}: cannot read the adapter at {request.lora_path!r}: "
            f"{type(e).__name__}: {e}"
        ) from e


def _load_adapter(
    request: LoRARequest, shapes: dict[str, tuple[int, int]], max_rank: int
) -> LoRAWeights:
    path, name = request.lora_path, request.lora_name
    cfg_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(cfg_path) or not os.path.isfile(weights_path):
        raise AdapterError(
            f"LoRA {name!r}: {path!r} must hold adapter_config.json and "
            "adapter_model.safetensors (peft's save_pretrained format)"
        )
    with open(cfg_path) as f:
        cfg = json.load(f)
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"LoRA {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for option, off in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if cfg.get(option, off) not in (off, None):
            raise AdapterError(f"LoRA {name!r}: {option}={cfg[option]!r} is not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(
            f"LoRA {name!r}: modules_to_save={cfg['modules_to_save']} is not supported"
        )
    targets = cfg.get("target_modules") or []
    # A list names modules; a string is a regex over full names, checked via the tensors below.
    for target in targets if isinstance(targets, list) else []:
        if target.rsplit(".", 1)[-1] not in TARGET_MODULES and target != "all-linear":
            raise AdapterError(
                f"LoRA {name!r}: target module {target!r} is not one ember can adapt "
                f"(supported: {', '.join(TARGET_MODULES)})"
            )
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"LoRA {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"LoRA {name!r}: rank {rank} exceeds max_lora_rank={max_rank}")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"LoRA {name!r}: per-module rank/alpha patterns are not supported")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = load_file(weights_path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in stem:
                module = stem.split(marker)[0]
                pairs.setdefault(module, {})[part] = tensor
                break
        else:
            raise AdapterError(f"LoRA {name!r}: unexpected tensor {key!r}")
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in pairs.items():
        leaf = module.rsplit(".", 1)[-1]
        if module not in shapes:
            raise AdapterError(
                f"LoRA {name!r}: target module {module!r} is not one ember can adapt in this "
                f"base model (supported: {', '.join(TARGET_MODULES)})"
                if leaf not in TARGET_MODULES
                else f"LoRA {name!r}: module {module!r} does not exist in the base model"
            )
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"LoRA {name!r}: {module!r} lacks lora_A or lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        fan_in, fan_out = shapes[module]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise AdapterError(
                f"LoRA {name!r}: {module!r} has A {tuple(a.shape)} / B {tuple(b.shape)}, the base "
                f"model needs ({rank}, {fan_in}) / ({fan_out}, {rank}): a different base model?"
            )
        modules[module] = (a.float(), b.float() * scaling)
    if not modules:
        raise AdapterError(f"LoRA {name!r}: no LoRA weights in {weights_path!r}")
    return LoRAWeights(name, rank, modules)
