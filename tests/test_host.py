"""The trust boundary of the caches ember loads code from, and the exact CPU target in keys."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time

import pytest

from ember import kernels
from ember.compile import inductor
from ember.host import dirs
from ember.host import isa as host_isa
from ember.host import memory as host
from tests.conftest import huge_page_kib


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_private_dir_creates_0700_and_refuses_dirs_others_can_write(tmp_path, caplog):
    os.chmod(tmp_path, 0o755)
    made = dirs.private_dir(str(tmp_path / "cache" / "kernels"), "kernel cache")
    assert made is not None and _mode(made) == 0o700
    assert dirs.private_dir(made, "kernel cache") == made  # idempotent

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert dirs.private_dir(str(shared), "compile cache") is None
    assert f"not using compile cache {shared}: it is writable by group or others" in caplog.text

    # A private dir under a parent anyone may write to (and that is not sticky, as /tmp is)
    # can be swapped for someone else's.
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    assert dirs.private_dir(str(loose / "inner"), "compile cache") is None
    os.chmod(loose, 0o1777)
    assert dirs.private_dir(str(loose / "inner"), "compile cache") == str(loose / "inner")


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_private_dir_refuses_a_dir_owned_by_another_user(tmp_path, caplog):
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, 4242, -1)
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert dirs.private_dir(str(other), "kernel cache") is None
    assert "owned by uid 4242" in caplog.text


def test_kernel_build_dir_falls_back_to_a_fresh_private_dir(tmp_path, monkeypatch):
    root = tmp_path / "xdg"
    root.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    good = kernels._build_dir("ember_cpu-test")
    assert good == str(root / "ember" / "kernels" / "ember_cpu-test") and _mode(good) == 0o700
    os.chmod(good, 0o777)
    fallback = kernels._build_dir("ember_cpu-test")
    assert fallback != good and _mode(fallback) == 0o700 and not os.listdir(fallback)


def test_prune_cache_evicts_least_recently_used_entries_idle_long_enough(tmp_path):
    now = time.time()

    def entry(name: str, nbytes: int, age_s: float, directory: bool = False) -> str:
        path = tmp_path / name
        if directory:  # a compile-cache entry: a tree of files
            (path / "graphs").mkdir(parents=True)
            (path / "graphs" / "g.bin").write_bytes(b"x" * (nbytes - 10))
            (path / "key.json").write_bytes(b"x" * 10)
        else:
            path.write_bytes(b"x" * nbytes)
        os.utime(path, (now - age_s, now - age_s))
        return str(path)

    oldest = entry("a.pkl", 300, age_s=9000)
    old_tree = entry("b", 300, age_s=8000, directory=True)
    kept = entry("c.pkl", 300, age_s=7000)  # the one just written, whatever its mtime
    used = entry("d.pkl", 300, age_s=7000)
    dirs.touch(used)  # read just now: recently used
    recent = entry("e.pkl", 300, age_s=60)  # another process may be reading it
    hidden = entry(".tmp-f", 300, age_s=9000)  # being written
    entry(".evicted-g-1", 300, age_s=9000, directory=True)  # left by a killed process

    # 1800 bytes (the leftover is deleted, not counted), over 800: the two oldest go, and
    # every other entry is exempt.
    evicted = dirs.prune_cache(str(tmp_path), 800, keep=kept)
    assert evicted == [oldest, old_tree]
    assert sorted(os.listdir(tmp_path)) == sorted(
        os.path.basename(p) for p in (kept, used, recent, hidden)
    )
    # Nothing else is old enough to go, however far over the cap the rest is.
    assert dirs.prune_cache(str(tmp_path), 0, keep=kept) == []
    assert dirs.prune_cache(str(tmp_path / "missing"), 0) == []


def test_compile_cache_default_is_the_user_cache_and_only_it_is_pruned(tmp_path, monkeypatch):
    from ember.compile import cache
    from ember.runtime.config import _compile_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("EMBER_DISABLE_COMPILE_CACHE")
    default = str(tmp_path / "xdg" / "ember" / "compile")
    assert _compile_cache_dir("auto", freeze_weights=False) == default
    assert _compile_cache_dir("auto", freeze_weights=True) is None  # frozen: not cacheable
    assert _compile_cache_dir("", freeze_weights=False) is None
    assert _compile_cache_dir(None, freeze_weights=False) is None
    assert _compile_cache_dir("/some/dir", freeze_weights=False) == "/some/dir"
    monkeypatch.setenv("EMBER_DISABLE_COMPILE_CACHE", "1")
    assert _compile_cache_dir("auto", freeze_weights=False) is None
    assert _compile_cache_dir("/some/dir", freeze_weights=False) == "/some/dir"

    monkeypatch.setattr(cache, "COMPILE_CACHE_MAX_BYTES", 0)
    old = time.time() - 2 * dirs.PRUNE_MIN_IDLE_S
    for directory in (default, str(tmp_path / "mine")):
        first = cache.mark_complete(directory, {"n": 1})
        os.utime(first, (old, old))
        second = cache.mark_complete(directory, {"n": 2})
        assert cache.lookup(directory, {"n": 2})
        # Over the cap: the default cache keeps only the entry just made; a dir the user
        # named keeps everything.
        expect = [second] if directory == default else sorted([first, second])
        assert sorted(os.path.join(directory, e) for e in os.listdir(directory)) == expect


def test_cache_entry_records_the_vec_isa_probes_and_a_broken_key_file_misses(tmp_path):
    from ember.compile import cache

    probes = ["/c/inductor/b/probe.so", "/c/inductor/a/probe.so"]
    entry = cache.mark_complete(str(tmp_path), {"n": 1}, probes)
    record = cache.lookup(str(tmp_path), {"n": 1})
    assert record == {"n": 1, cache.VEC_ISA_RECORD: sorted(probes)}
    assert cache.recorded_probes(record) == sorted(probes)
    assert cache.lookup(str(tmp_path), {"n": 2}) is None
    for other in (None, {"n": 1}, {cache.VEC_ISA_RECORD: "x.so"}, {cache.VEC_ISA_RECORD: [1]}):
        assert cache.recorded_probes(other) == []
    with open(os.path.join(entry, cache.KEY_FILE), "w") as f:
        f.write("{truncated")  # a key file cut short: not a complete entry
    assert cache.lookup(str(tmp_path), {"n": 1}) is None


def test_vec_isa_probes_pass_known_libraries_and_record_only_real_passes(monkeypatch):
    from torch._inductor import cpu_vec_isa

    loaded = []

    def dlopen_in_a_child(self, path):  # inductor's probe, faked: only "good" libraries load
        loaded.append(path)
        return "good" in path

    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", dlopen_in_a_child)
    isa = cpu_vec_isa.VecAVX2()
    with inductor.vec_isa_probes(["known.so"]) as passed:
        assert isa._probe_load("known.so")  # loaded in an earlier probe: no child
        assert isa._probe_load("good.so") and not isa._probe_load("bad.so")
    assert loaded == ["good.so", "bad.so"] and passed == ["good.so"]
    assert cpu_vec_isa.VecISA._probe_load is dlopen_in_a_child  # restored
    assert not isa._probe_load("known.so")  # outside the block, probed as always


def test_cpu_target_is_the_exact_march_expansion():
    native = host_isa.cpu_target()
    assert native == host_isa.cpu_target("-march=native")  # stable
    v3 = host_isa.cpu_target("-march=x86-64-v3")
    assert v3.startswith("x86-64-v3-") and v3 != native


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_the_march_expansion_is_kept_per_compiler_and_cpu(tmp_path, monkeypatch):
    """The compiler is asked once per (compiler, -march, CPU); later processes read its answer
    from the kernel cache; an unreadable entry is asked again, and a new CPU gets its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    asked = []
    real_ask = host_isa._ask_compiler
    monkeypatch.setattr(host_isa, "_ask_compiler", lambda m: asked.append(m) or real_ask(m))

    def fresh(march: str = "-march=native") -> tuple[str, tuple[str, ...]]:
        host_isa._march.cache_clear()  # as a new process
        return host_isa._march(march)

    first = fresh()
    assert asked == ["-march=native"] and first[0] != "cpu"
    assert fresh() == first and asked == ["-march=native"]  # read back, not asked
    assert fresh("-march=x86-64-v3") != first and len(asked) == 2
    entries = sorted((tmp_path / "ember" / "kernels").glob("march-*.txt"))
    assert len(entries) == 2
    for entry in entries:
        entry.write_text("")
    assert fresh() == first and len(asked) == 3  # unreadable: asked again
    monkeypatch.setattr(host_isa, "_cpu_identity", lambda: "another CPU")
    assert fresh() == first and len(asked) == 4
    host_isa._march.cache_clear()


def test_zeroed_lazily_is_zero_and_takes_memory_only_where_touched():
    import torch

    def rss_mib() -> float:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024

    before = rss_mib()
    big = host.zeroed_lazily((256, 1024, 1024), torch.float32)  # 1 GiB
    assert big.shape == (256, 1024, 1024) and big.dtype == torch.float32
    assert big.is_contiguous()
    assert float(big[::16, ::256, ::512].abs().sum()) == 0.0  # reads a few pages
    assert rss_mib() - before < 64
    big[3, 5, 7] = 2.0
    assert float(big[3].sum()) == 2.0
    small = host.zeroed_lazily((4, 16, 2, 8), torch.bfloat16)
    assert small.dtype == torch.bfloat16 and not small.any()
    assert host.zeroed_lazily((0, 8), torch.float32).shape == (0, 8)


def test_weights_move_to_huge_pages_keeping_identity_views_and_ties():
    import torch

    base = torch.randn(1024, 1024)  # 4 MiB: spans huge pages
    view = base[512:]  # shares base's storage
    tied = torch.nn.Parameter(torch.randn(300, 700), requires_grad=False)
    small = torch.randn(8)  # under the size floor: stays put
    half = torch.randn(2000, 300).to(torch.bfloat16).t()  # non-contiguous, 16-bit
    want = [t.clone() for t in (base, view, tied, small, half)]
    small_ptr = small.data_ptr()
    ids = [id(t) for t in (base, view, tied, small, half)]
    moved = host.move_to_huge_pages([base, view, tied, tied, small, half])
    if not host.huge_pages_available():
        assert moved == 0
        pytest.skip("no transparent huge pages for anonymous memory here")
    assert moved >= (4 << 20) + 300 * 700 * 4 + 2000 * 300 * 2
    got = (base, view, tied, small, half)
    assert [id(t) for t in got] == ids and isinstance(tied, torch.nn.Parameter)
    for t, w in zip(got, want, strict=True):
        assert t.dtype == w.dtype and t.shape == w.shape and torch.equal(t, w)
    assert half.stride() == (1, 300)
    assert small.data_ptr() == small_ptr
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    view[0, 0] = 123.0  # still a view of base
    assert float(base[512, 0]) == 123.0
    host.collapse_to_huge_pages(wait=True)
    assert huge_page_kib(base) >= 2048
    assert torch.equal(half, want[4]) and float(base[512, 0]) == 123.0


def test_weight_zeros_are_lazily_zeroed_maps_that_stay_in_place():
    import torch

    size = host._OWN_MAP_MIN_BYTES + (1 << 20)
    big = host.weight_zeros((size,), torch.uint8)
    small = host.weight_zeros((1000,), torch.float32)
    assert big.dtype == torch.uint8 and not big.any() and not small.any()
    if not host.huge_pages_available():
        pytest.skip("no transparent huge pages for anonymous memory here")
    big[:] = 7
    ptr = big.data_ptr()
    moved = host.move_to_huge_pages([big, small])
    assert big.data_ptr() == ptr and moved == 0  # already in its own huge-page map
    host.collapse_to_huge_pages(wait=True)
    assert huge_page_kib(big) >= 2048 and int(big.sum()) == 7 * size


def test_weights_built_in_an_arena_are_zeroed_aligned_and_stay_put_and_become_huge_pages():
    import torch

    if not host.huge_pages_available():
        with host.weight_arena(1 << 20, 1 << 20) as arena:
            assert arena is None and not host.weight_zeros((10,), torch.half).any()
        pytest.skip("no transparent huge pages for anonymous memory here")
    host.collapse_to_huge_pages(wait=True)  # no earlier engine's thread collapses this one's
    with host.weight_arena(8 << 20, 4 << 20) as arena:
        assert arena is not None
        codes = host.weight_zeros((3, 1000), torch.uint8)
        scales = host.weight_zeros((3, 7), torch.half)  # after 3000 bytes, realigned
        big = host.weight_zeros((9 << 20,), torch.uint8)  # no room left: elsewhere
        assert not codes.any() and not scales.any() and not big.any()
        assert scales.data_ptr() % 64 == 0 and scales.shape == (3, 7)
        assert scales.untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()
        assert big.untyped_storage().data_ptr() != codes.untyped_storage().data_ptr()
        with host.weight_arena(1 << 20, 0) as nested:
            assert nested is None  # the outer arena stays the one in use
        codes[:] = 5
        scales[:] = 0.5
    assert arena.used == 3008 + 3 * 7 * 2  # 3000 bytes, then the scales from 47 * 64
    assert codes.data_ptr() % host._HUGE_PAGE == 0
    want = (codes.clone(), scales.clone())
    assert host.move_to_huge_pages([codes, scales]) == 0  # built in its own map: not moved
    if host._can_collapse():  # written in 4 KiB pages, collapsed once the engine is ready
        assert huge_page_kib(codes) == 0
    host.collapse_to_huge_pages(wait=True)
    assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])
    assert huge_page_kib(codes) >= 2048
    assert not host.weight_zeros((4,), torch.half).any()  # outside the block: the heap


def test_heap_trimmer_trims_after_enough_bytes(monkeypatch):
    calls = []
    monkeypatch.setattr(host, "_malloc_trim", lambda: calls.append)
    heap = host.HeapTrimmer(every=100)
    heap.freed(60)
    assert calls == []
    heap.freed(60)
    assert calls == [0]
    heap.freed(99)
    assert calls == [0]


def test_a_loaded_models_weights_and_kv_cache_are_in_huge_pages(checkpoint_dir):
    if not host.huge_pages_available():
        pytest.skip("no transparent huge pages for anonymous memory here")
    from ember import LLM

    # a 4 MiB embedding table: the weights span whole huge pages
    llm = LLM(
        model=checkpoint_dir("tiny-llama", vocab_size=16384), compile=False, kv_cache_gib=0.05
    )
    runner = llm.llm_engine.runner
    embed = runner.model.get_input_embeddings().weight
    assert embed.untyped_storage().nbytes() >= 64 * 1024
    with host._collapse_lock:  # the engine started collapsing its weights' pages
        assert not host._to_collapse or host._collapser is not None
    host.collapse_to_huge_pages(wait=True)
    assert huge_page_kib(embed) >= 2048
    cache = runner.kv_caches[0]
    cache.view(-1)[:: 1 << 18] = 0.0  # touch it
    assert huge_page_kib(cache) >= 2048


def test_collapsing_stops_at_exit_after_the_page_it_is_on(monkeypatch):
    import threading

    if not host._can_collapse():
        pytest.skip("the kernel cannot collapse pages into huge pages here (Linux < 6.1)")
    host.collapse_to_huge_pages(wait=True)
    monkeypatch.setattr(host, "_collapse_stop", threading.Event())  # this test's exit only
    weights = host._weight_map(256 << 20)
    weights[::4096] = 1
    host.collapse_later(weights)
    host.collapse_to_huge_pages()
    thread = host._collapser
    assert thread is not None
    host._stop_collapsing()  # what the interpreter runs at exit
    assert not thread.is_alive() and host._collapser is None
    assert huge_page_kib(weights) < 256 << 10  # stopped part way
    host.collapse_to_huge_pages()  # stopped for good
    assert host._collapser is None and int(weights[::4096].sum()) == 65536


_EXIT_WHILE_COLLAPSING = """
import torch
from ember.host import memory as host
weights = host.weight_zeros((256 << 20,), torch.uint8)
weights[::4096] = 1  # written in 4 KiB pages
host.collapse_to_huge_pages()
print("queued", flush=True)
"""


def test_a_process_that_exits_while_its_weights_collapse_exits_cleanly():
    """The collapsing thread is inside madvise most of the time: were it left running at
    exit, the interpreter's finalization would abort the process (SIGABRT, "terminate called
    without an active exception"), as it did for a script that exited right after loading."""
    import subprocess
    import sys

    for _ in range(3):
        child = subprocess.run(
            [sys.executable, "-c", _EXIT_WHILE_COLLAPSING],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == 0 and "queued" in child.stdout, child.stderr[-2000:]


_PREBUILD_CHILD = """
import sys
import torch
import ember
from ember import kernels
assert "transformers" not in sys.modules, "import ember pulled in transformers"
kernels.prebuild("native")
predicted = kernels.panel_width()
from ember.model.layers.group import GroupLinear, quantize_groups
torch.manual_seed(0)
codes, scales, mins = quantize_groups(torch.randn(40, 64), 4, False)
layer = GroupLinear(codes, scales, mins, 4)  # laid out while the build may still run
x = torch.randn(3, 64)
y = layer(x)  # waits for the build
from ember.host.isa import resolve_isa
assert kernels.loaded_isa() == resolve_isa("native"), kernels.loaded_isa()  # avx2 when forced
assert kernels.panel_width() == predicted, (kernels.panel_width(), predicted)
ref = x @ layer.rows(slice(None)).T
print(float((y - ref).abs().max() / ref.abs().max()))
"""


def test_a_prebuild_runs_in_the_background_and_load_waits_for_it():
    """A fresh process, as the `ember` command runs: `import ember` stays light (the runtime and
    transformers come on first use), weights are laid out in panels of the width the build
    will have before it has loaded, and the first op call waits for the build."""
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-c", _PREBUILD_CHILD], capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert float(child.stdout.strip().splitlines()[-1]) < 0.05  # x is quantized to int8


def test_load_without_an_isa_takes_the_one_a_prebuild_started(monkeypatch, tmp_path):
    """The loaders call `load()` / `ready()` without an ISA: with `cpu_isa="avx2"` prebuilt,
    they must take the AVX2 build, not load the native one first (which the engine's own
    `load("avx2")` would then refuse)."""
    from ember import kernels

    loaded: list[str] = []
    monkeypatch.setattr(kernels, "_loaded_isa", None)
    monkeypatch.setattr(kernels, "_prebuild_isa", "avx2")
    monkeypatch.setattr(kernels, "_build_and_load", loaded.append)
    library = tmp_path / "ember_cpu.so"
    monkeypatch.setattr(kernels, "_build", lambda isa: kernels._Build(str(library), [isa]))
    assert not kernels.ready()
    library.write_bytes(b"")
    assert kernels.ready()
    kernels.load()
    assert loaded == ["avx2"] and kernels.loaded_isa() == "avx2"


def test_the_ember_command_reads_the_cpu_isa_flag():
    from ember.entry import _cpu_isa

    assert _cpu_isa(["--cpu-isa", "avx2"]) == "avx2"
    assert _cpu_isa(["--cpu-isa=avx2", "--prompt", "x"]) == "avx2"
    assert _cpu_isa(["--prompt", "x"]) == "native"
    # an abbreviation the command's own parser accepts
    assert _cpu_isa(["--prompt", "x", "--cpu", "avx2"]) == "avx2"


_EXIT_CHILD = """
import atexit, sys, threading, time
from ember.entry import _exit_now

def late():
    time.sleep(0.3)
    print("thread done")

threading.Thread(target=late).start()  # not a daemon: the interpreter would wait for it
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(2)  # idle workers, stopped by its exit hook
pool.submit(time.sleep, 0.01).result()
atexit.register(lambda: print("atexit ran"))
print("buffered", end="")  # stdout is a pipe here: block-buffered until flushed
_exit_now(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_the_ember_command_exits_as_the_interpreter_would(code):
    """`ember` leaves without the interpreter's teardown (`_exit_now`), yet as it would: the
    command's exit status, non-daemon threads finished, atexit functions run, output flushed."""
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-c", _EXIT_CHILD, str(code)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == code, child.stderr[-2000:]
    assert child.stdout == "bufferedthread done\natexit ran\n"


_FAILED_BUILD_CHILD = """
from ember import kernels
kernels.prebuild("native")  # starts the (failing) compiler; the thread's load fails quietly
try:
    kernels.load("native")
except RuntimeError as e:
    print(e)
else:
    raise SystemExit("a failed build loaded")
assert not kernels.available("native")
"""


def test_a_failed_kernel_build_names_the_library_and_the_compiler_output(tmp_path):
    import subprocess
    import sys

    compiler = tmp_path / "cxx"
    compiler.write_text("#!/bin/sh\necho 'error: no compiler here' >&2\nexit 1\n")
    compiler.chmod(0o755)
    env = {**os.environ, "CXX": str(compiler), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    child = subprocess.run(
        [sys.executable, "-c", _FAILED_BUILD_CHILD],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert "cannot build ember's C++ kernels" in child.stdout
    assert "error: no compiler here" in child.stdout
    assert not list((tmp_path / "cache").rglob("*.so*"))  # no library, no stray output
