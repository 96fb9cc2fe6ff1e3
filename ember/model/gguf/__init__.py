"""GGUF files (llama.cpp's format): reading a file and its tensor index (`reader`), its
transformers config and tokenizer (`hf`), the cache of what is converted from it (`cache`),
block converters to ember's layers (`convert`) and the loader that builds the model (`load`)."""
