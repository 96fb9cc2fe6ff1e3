"""Adapters known to the engine and the `max_loras` resident slots, swapped in LRU order.

`add` reads and validates an adapter once (kept in CPU memory); `activate` makes a step's
adapters resident, writing their weights into the wrappers' slot tensors and evicting the least
recently used adapters the step does not need. The scheduler guarantees that a step never holds
more than `max_loras` distinct adapters.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from ember.lora.adapter import AdapterError, LoRARequest, LoRAWeights, load_adapter
from ember.lora.layers import LoRALinear


class LoRAManager:
    def __init__(
        self,
        wrapped: dict[str, LoRALinear],
        token_slots: torch.Tensor,
        max_loras: int,
        max_rank: int,
    ) -> None:
        self.wrapped = wrapped
        self.token_slots = token_slots
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.shapes = {n: (m.base.in_features, m.base.out_features) for n, m in wrapped.items()}
        self.adapters: dict[int, tuple[LoRARequest, LoRAWeights]] = {}
        # lora id -> a digest of the adapter now under that id (its modules' A and B as
        # loaded): prefix-cache keys are salted with it, so K/V one adapter computed are never
        # read under another, in this process or, on disk, in a later one.
        self.digest: dict[int, bytes] = {}
        # lora id -> slot, least recently used first.
        self.resident: OrderedDict[int, int] = OrderedDict()
        self.num_swaps = 0

    def add(self, request: LoRARequest) -> None:
        """Read and validate the adapter (AdapterError if it does not fit); no-op if known."""
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if known[0].lora_path != request.lora_path:
                raise AdapterError(
                    f"lora_int_id {request.lora_int_id} is already {known[0].lora_name!r} at "
                    f"{known[0].lora_path!r}"
                )
            return
        weights = load_adapter(request, self.shapes, self.max_rank)
        self.adapters[request.lora_int_id] = (request, weights)
        self.digest[request.lora_int_id] = adapter_digest(weights)

    def remove(self, lora_id: int) -> bool:
        slot = self.resident.pop(lora_id, None)
        if slot is not None:
            self._clear(slot)
        self.digest.pop(lora_id, None)
        return self.adapters.pop(lora_id, None) is not None

    def requests(self) -> list[LoRARequest]:
        return [req for req, _ in self.adapters.values()]

    def _clear(self, slot: int) -> None:
        for module in self.wrapped.values():
            module.lora_a[slot].zero_()
            module.lora_b[slot].zero_()

    def _load(self, lora_id: int, slot: int) -> None:
        _, weights = self.adapters[lora_id]
        for name, module in self.wrapped.items():
            a_slot, b_slot = module.lora_a[slot], module.lora_b[slot]
            a_slot.zero_()
            b_slot.zero_()
            pair = weights.modules.get(name)
            if pair is not None:
                a, b = pair
                a_slot[: weights.rank].copy_(a)
                b_slot[:, : weights.rank].copy_(b)
        self.num_swaps += 1

    def activate(self, lora_ids: set[int]) -> dict[int, int]:
        """Make `lora_ids` resident; returns lora id -> slot."""
        if len(lora_ids) > self.max_loras:
            raise RuntimeError(f"{len(lora_ids)} adapters in one step, max_loras={self.max_loras}")
        for lora_id in lora_ids:
            if lora_id in self.resident:
                self.resident.move_to_end(lora_id)
        for lora_id in lora_ids:
            if lora_id in self.resident:
                continue
            if len(self.resident) < self.max_loras:
                used = set(self.resident.values())
                slot = next(s for s in range(self.max_loras) if s not in used)
            else:
                victim = next(i for i in self.resident if i not in lora_ids)
                slot = self.resident.pop(victim)
            self._load(lora_id, slot)
            self.resident[lora_id] = slot
        return {i: self.resident[i] for i in lora_ids}

    def set_token_slots(self, slots: torch.Tensor | None) -> None:
        """Copy a step's per-token slots (`ForwardBatch.lora_slots`) into the buffer every
        wrapper reads during the next forward (-1 past the tokens)."""
        n = 0 if slots is None else slots.shape[0]
        if slots is not None:
            self.token_slots[:n] = slots
        self.token_slots[n:] = -1


def adapter_digest(weights: LoRAWeights) -> bytes:
    """sha256 over each wrapped module's name and its A and B (scaling folded in) as loaded:
    equal only for adapters whose every delta is equal."""
    h = hashlib.sha256()
    for name in sorted(weights.modules):
        h.update(name.encode())
        for t in weights.modules[name]:
            h.update(f"{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()
