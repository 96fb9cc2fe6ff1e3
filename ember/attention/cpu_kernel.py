"""The C paged-attention kernel of the "torch" CPU backend: build, load, run in parallel.

`csrc/paged_attention.c` is compiled once with the system C compiler (about a second; no torch
headers) into the user cache dir, keyed by its source, flags and CPU, and loaded with ctypes.
ctypes releases the GIL during the call, so a small persistent thread pool runs disjoint ranges
of (token, KV head) items on all cores. When no compiler is present or the build fails, the
backend falls back to its pure-PyTorch path (`available()` is False, with the reason logged).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger("ember")

_SRC = Path(__file__).parent / "csrc" / "paged_attention.c"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-shared", "-fPIC"]
MAX_GROUP, MAX_HEAD_DIM = 16, 256
# Below this many items, threads cost more than they save.
_MIN_ITEMS_PER_THREAD = 8


def _cache_root() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "ember" / "kernels"


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler found; paged attention uses the pure-PyTorch path")
        return None
    source = _SRC.read_bytes()
    key = hashlib.sha256(
        source
        + " ".join(_FLAGS).encode()
        + platform.machine().encode()
        + torch.backends.cpu.get_cpu_capability().encode()
    ).hexdigest()[:16]
    target = _cache_root() / f"paged_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            proc = subprocess.run(
                [compiler, *_FLAGS, str(_SRC), "-o", str(built), "-lm"],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                logger.warning(
                    "building the paged-attention kernel failed (%s); using the pure-PyTorch path",
                    proc.stderr.strip()[:500],
                )
                return None
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
    ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
    for name in ("paged_attention_f32", "paged_attention_bf16"):
        fn = getattr(lib, name)
        fn.restype = None
        # q, out, k_cache, v_cache, block_tables, bt_stride, tokens, tok_seq, tok_pos, seq_lens,
        # item_begin, item_end, num_heads, num_kv_heads, head_dim, block_size, scale,
        # sliding_window, softcap, causal
        fn.argtypes = [ptr] * 5 + [i64] + [ptr] * 4 + [i64] * 6 + [f32, i32, f32, i32]
    return lib


def available() -> bool:
    return _library() is not None


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    return (
        num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
        and dtype in (torch.float32, torch.bfloat16)
    )


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(
        max_workers=max(torch.get_num_threads(), 1), thread_name_prefix="ember-attn"
    )


def _split(costs: torch.Tensor, num_kv_heads: int, parts: int) -> list[tuple[int, int]]:
    """Item ranges of about equal cost; `costs [num_tokens]` is keys visited per token."""
    num_items = costs.shape[0] * num_kv_heads
    if parts <= 1 or num_items < 2 * _MIN_ITEMS_PER_THREAD:
        return [(0, num_items)]
    if costs.shape[0] < 2 * parts:  # few tokens (small-batch decode): split the heads evenly
        step = -(-num_items // parts)
        return [(i, min(i + step, num_items)) for i in range(0, num_items, step)]
    cum = costs.cumsum(0)
    targets = cum[-1] * torch.arange(1, parts) / parts
    cuts = (torch.searchsorted(cum, targets) + 1).tolist()
    bounds = [0, *[c * num_kv_heads for c in cuts], num_items]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def paged_attention(
    query: torch.Tensor,
    out: torch.Tensor,
    tokens: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    causal: bool,
) -> None:
    """Attend the query rows `tokens [n]` over the paged cache (K/V already written), writing
    float32 rows of `out [num_tokens, num_heads, head_dim]`."""
    lib = _library()
    assert lib is not None, "check available() first"
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_real = int(query_start_loc[-1])
    if tokens.numel() == 0:
        return
    q = query[:num_real].float().contiguous()
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    tok_seq = torch.repeat_interleave(torch.arange(q_lens.shape[0]), q_lens)
    tok_pos = seq_lens.long()[tok_seq] - q_lens[tok_seq] + torch.arange(num_real) - qsl[tok_seq]
    hi = tok_pos if causal else seq_lens.long()[tok_seq] - 1
    lo = (tok_pos - sliding_window + 1).clamp(min=0) if sliding_window > 0 else torch.zeros_like(hi)
    tables = block_tables.to(torch.int32).contiguous()
    tokens32 = tokens.to(torch.int32).contiguous()
    tok_seq32, tok_pos32 = tok_seq.to(torch.int32), tok_pos.to(torch.int32)
    lens32 = seq_lens.to(torch.int32).contiguous()
    cache = kv_cache if kv_cache.is_contiguous() else kv_cache.contiguous()
    fn = lib.paged_attention_bf16 if cache.dtype == torch.bfloat16 else lib.paged_attention_f32
    assert out.is_contiguous() and out.dtype == torch.float32

    def run(begin: int, end: int) -> None:
        fn(
            q.data_ptr(),
            out.data_ptr(),
            cache[0].data_ptr(),
            cache[1].data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            tokens32.data_ptr(),
            tok_seq32.data_ptr(),
            tok_pos32.data_ptr(),
            lens32.data_ptr(),
            begin,
            end,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            sliding_window,
            softcap,
            int(causal),
        )

    costs = (hi - lo + 1).clamp(min=0)[tokens.long()]
    ranges = _split(costs, num_kv_heads, torch.get_num_threads())
    if len(ranges) == 1:
        run(*ranges[0])
    else:
        for future in [_pool().submit(run, a, b) for a, b in ranges]:
            future.result()
