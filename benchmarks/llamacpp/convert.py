"""Convert an ember-built random checkpoint to GGUF with llama.cpp's own converter.

ember's checkpoints carry a small byte-level BPE tokenizer whose hash llama.cpp's converter does
not know, and the Llama path wants sentencepiece; the benchmarks feed token ids, so the vocab
only has to be the right size. This runs `convert_hf_to_gguf.py` with the vocab step routed to
its GPT-2 BPE writer and the pre-tokenizer named "gpt-2". Weights and hyper-parameters go
through the converter unchanged.

usage: python convert.py LLAMA_CPP_DIR CHECKPOINT_DIR OUT.gguf f16|f32|bf16|q8_0
"""

from __future__ import annotations

import runpy
import sys

llama_cpp, checkpoint, out, outtype = sys.argv[1:5]
sys.path[:0] = [llama_cpp, f"{llama_cpp}/gguf-py"]

from conversion import base  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
base.TextModel.set_vocab = base.TextModel._set_vocab_gpt2
for module in ("llama", "qwen"):
    mod = __import__(f"conversion.{module}", fromlist=["*"])
    for cls in vars(mod).values():
        if isinstance(cls, type) and "set_vocab" in vars(cls):
            cls.set_vocab = base.TextModel._set_vocab_gpt2

sys.argv = ["convert_hf_to_gguf.py", checkpoint, "--outtype", outtype, "--outfile", out]
runpy.run_path(f"{llama_cpp}/convert_hf_to_gguf.py", run_name="__main__")
