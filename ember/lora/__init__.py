"""Multi-LoRA serving: PEFT adapters in preallocated slots, applied inside the compiled graph."""
