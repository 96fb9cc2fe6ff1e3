"""Shared fixtures: tiny seeded checkpoints (built once per session) and the HF reference."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import ember.host  # noqa: F401  (EMBER_CPU_ISA=avx2 caps ATen before torch runs its first kernel)

pytest_plugins = ["tests.host_isa"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels (the "triton" attention backend) run in Triton's CPU interpreter here. Triton
# reads this when it is first imported (torch and transformers may import it), so it is set
# before anything else; export TRITON_INTERPRET=0 on a GPU machine to run the real kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")


def _private_cache_root() -> str:
    """A user cache dir for this session (removed at exit), so the files tests convert or
    compile (GGUF configs and tokenizers, checkpoints, compile caches) never land in the
    user's own. The built kernels are copied in: they depend only on the sources and the CPU,
    and building them again would add minutes to every run."""
    from ember.host.dirs import user_cache_dir

    kernels = user_cache_dir("kernels")
    root = tempfile.mkdtemp(prefix="ember-test-cache-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    private = os.path.join(root, "ember", "kernels")
    if os.path.isdir(kernels):
        shutil.copytree(kernels, private, symlinks=True)
    atexit.register(_keep_new_kernel_builds, private, kernels)  # runs before the rmtree
    return root


def _keep_new_kernel_builds(private: str, kernels: str) -> None:
    """At exit, the kernel builds this session made (build directories holding a library)
    copied back into the user's kernel cache, which the next session copies in: a build
    depends only on the sources, its flags and the CPU (its directory name hashes them). The
    [avx2-host] child and the scalar-build test's child (each a session whose "user cache" is
    its parent's private one, so their builds travel up) built theirs afresh every run, about
    15 s of one core each."""
    if not os.path.isdir(private):
        return
    for name in os.listdir(private):
        src, dst = os.path.join(private, name), os.path.join(kernels, name)
        if os.path.exists(dst) or not os.path.isdir(src):
            continue
        if not any(f.endswith(".so") for f in os.listdir(src)):
            continue  # a failed or unfinished build
        tmp = f"{dst}.tmp{os.getpid()}"
        try:
            os.makedirs(kernels, mode=0o700, exist_ok=True)
            shutil.copytree(src, tmp, symlinks=True)
            os.rename(tmp, dst)  # whole, or not at all
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)


os.environ["XDG_CACHE_HOME"] = _private_cache_root()
# Engines compile afresh unless a test names a cache dir: each test traces and compiles what
# it checks, and none loads graphs that another test's settings or monkeypatches shaped.
os.environ.setdefault("EMBER_DISABLE_COMPILE_CACHE", "1")

from ember.tools.checkpoints import build_checkpoint  # noqa: E402

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-mistral"]


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """`checkpoint_dir(shape, **overrides)` -> a directory with a seeded random checkpoint."""
    root = tmp_path_factory.mktemp("ckpt")
    made: dict[str, str] = {}

    def make(shape: str = "tiny-llama", dtype: torch.dtype = torch.float32, **overrides) -> str:
        key = f"{shape}-{str(dtype).split('.')[-1]}-" + "-".join(
            f"{k}{v}" for k, v in sorted(overrides.items())
        )
        if key not in made:
            made[key] = build_checkpoint(str(root / key), shape, dtype=dtype, **overrides)
        return made[key]

    return make


def group_quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the group kernels see it: int8 per group of 32, scale max|x| / 127 (llama.cpp's
    activation quantization; 127 / max as a true division, round half to even)."""
    groups = x.unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0)
    return (torch.round(groups * inv) * (amax / 127)).flatten(-2)


def build_tiny_bart(path: str, vocab_size: int, dtype: torch.dtype = torch.float32) -> str:
    """A seeded random BART saved in `dtype`; untied output embeddings, so greedy outputs vary
    with the input (with tied ones a random BART repeats its input token)."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=vocab_size,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=128,
        init_std=0.1,
        tie_word_embeddings=False,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
    )
    BartForConditionalGeneration(config).to(dtype).save_pretrained(path)
    return path


def build_tiny_bert(path: str, dtype: torch.dtype = torch.float32) -> str:
    """A seeded random BertModel (an embedding model) saved in `dtype`."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        architectures=["BertModel"],
    )
    BertModel(config).to(dtype).save_pretrained(path)
    return path


def hf_greedy(
    model_dir: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> list[list[int]]:
    """HF transformers `generate(do_sample=False)`, one prompt at a time, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            outs.append(ids[0, len(p) :].tolist())
    return outs


def hf_bart_greedy(
    model_dir: str,
    cases: list[tuple[list[int], list[int]]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> list[list[int]]:
    """HF BART greedy `generate` per (encoder ids, decoder prefix) case, the decoder prefix
    after `decoder_start_token_id`; no forced tokens, EOS ignored. Returns the new tokens."""
    from transformers import BartForConditionalGeneration

    model = BartForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
    start = model.config.decoder_start_token_id
    outs = []
    for enc, dec in cases:
        prefix = [start, *dec]
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([enc]),
                decoder_input_ids=torch.tensor([prefix]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                min_length=0,
                no_repeat_ngram_size=0,
                forced_bos_token_id=None,
                forced_eos_token_id=None,
                eos_token_id=None,
            )
        outs.append(ids[0, len(prefix) :].tolist())
    return outs


def make_prompts(
    num: int, seed: int = 0, low: int = 3, high: int = 40, vocab: int = 500
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high, (num,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def gib_for_blocks(
    model_dir: str, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> float:
    """kv_cache_gib that yields exactly `num_blocks` blocks (one is the reserved null block)."""
    from ember.model.spec import kv_geometry, load_hf_config
    from ember.runtime.config import KVCacheSpec

    layers, kv_heads, head_dim = kv_geometry(load_hf_config(model_dir).get_text_config())
    spec = KVCacheSpec(((kv_heads, head_dim),) * layers, block_size, num_blocks, dtype)
    return (num_blocks * spec.bytes_per_block + 1) / 2**30


def with_eos(model_dir: str, eos: int, dest: str) -> str:
    """Copy a checkpoint, declaring `eos` as its EOS token."""
    import json
    import shutil

    shutil.copytree(model_dir, dest)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(dest, name)
        if os.path.exists(path):
            with open(path) as f:
                cfg = json.load(f)
            cfg["eos_token_id"] = eos
            with open(path, "w") as f:
                json.dump(cfg, f)
    return dest


def drive_random(engine, prompts, params, rng, arrivals, abort_prob, check=None):
    """Feed `prompts` to `engine` as `arrivals()` new requests per step, aborting a random
    unfinished request with probability `abort_prob` per step, until all are done.

    Returns (token ids of every completion by request id, aborted ids, number of steps).
    """
    done: dict[str, list[list[int]]] = {}
    aborted: set[str] = set()
    pending = list(range(len(prompts)))
    steps = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(arrivals()):
            if pending:
                i = pending.pop(0)
                engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params[i])
        if rng.random() < abort_prob and engine.has_unfinished_requests():
            victim = rng.choice(sorted(engine.output_processor.parents))
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        if check is not None:
            check()
        steps += 1
    return done, aborted, steps


def huge_page_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mapping holding `t`'s data, from /proc/self/smaps."""
    addr, found = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                found = start <= addr < end
            elif found and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


_LOAD_RSS_CHILD = """
import json, os, sys
import torch
from ember.attention import get_backend
from ember.model.spec import read_model_spec
from ember.model.loader import load_model

def status_mib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024

def load(path, quantization):  # as the engine's dtype="auto" loads it
    spec = read_model_spec(path)
    weights = torch.bfloat16 if quantization is None else None  # (a GGUF file ignores it)
    return load_model(
        spec, torch.float32, get_backend("torch"), quantization=quantization, weight_dtype=weights
    )

path = sys.argv[2]
quantization = None if sys.argv[3] == "none" else sys.argv[3]
load(sys.argv[1], quantization)  # every import and the kernels, on a tiny model
before = status_mib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from here
loaded = load(path, quantization)
if os.path.isdir(path):
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(".safetensors"))
else:
    size = os.path.getsize(path)
print(json.dumps({
    "grown": status_mib("VmRSS") - before,
    "peak": status_mib("VmHWM") - before,
    "file": size / 2**20,
}))
"""


def load_rss_mib(
    tiny: str, path: str, quantization: str = "none", weights_cache: bool = True
) -> dict[str, float]:
    """Load `path` (a GGUF file or a safetensors checkpoint dir) with `load_model` in a fresh
    process, after loading `tiny` there (every import, the kernels); returns the RSS it
    `grown` by, at its `peak` (VmHWM restarted before it) and after, and the weights' `file`
    size, in MiB. `weights_cache=False`: with ember's weights cache off
    (`EMBER_WEIGHTS_CACHE_GB=0`), so the build itself is measured every time."""
    env = dict(os.environ)
    if not weights_cache:
        env["EMBER_WEIGHTS_CACHE_GB"] = "0"
    child = subprocess.run(
        [sys.executable, "-c", _LOAD_RSS_CHILD, tiny, path, quantization],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])
