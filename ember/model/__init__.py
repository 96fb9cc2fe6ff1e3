"""What a checkpoint is and how it becomes modules: its config facts (`spec`), loading HF
directories (`loader`) and GGUF files (`gguf`), the packed-weights cache (`packed_cache`),
ember's linears and embeddings and the rewrites that install them (`layers`), and the
model-family forwards the compiled graphs run (`forwards`)."""
