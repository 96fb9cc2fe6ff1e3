"""GGUF files (llama.cpp's format): ember's parser of a file (`reader`) and its index of the
tensors (`index`), its transformers config and tokenizer (`hf`) and tensor-name map (`names`),
the cache of what is converted from it (`cache`), block converters to ember's layers (`convert`)
and the loader that builds the model (`load`)."""
