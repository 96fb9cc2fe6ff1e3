"""The fast calls (`ember.kernels.install_fast_calls`): each is its op, called without Python's
op machinery; compiled graphs call them; arguments they do not read go to the op."""

from __future__ import annotations

import os
import sysconfig

import pytest
import torch

from ember import kernels
from tests.kernels import needs_compiler

# Skipped where there is no C++ compiler at all, never on a failed build (`_built`).
pytestmark = needs_compiler


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    kernels.load()  # a failed build fails every test of the module, with the compiler's output


def _python_headers() -> str | None:
    """Python.h's directory where it exists: the kernels are then built with the fast calls
    (`kernels._build_with`), else None."""
    include = sysconfig.get_paths()["include"]
    return include if os.path.exists(os.path.join(include, "Python.h")) else None


def _fast(name: str):
    call = kernels._fast_calls[name]
    if call is getattr(torch.ops.ember_cpu, name).default:
        if _python_headers() is not None:  # `test_fast_calls_are_built_where_they_can_be`
            pytest.fail(f"the fast call of {name} is missing though Python's headers exist")
        pytest.skip("this build has no fast calls (no Python headers)")
    return call


def test_fast_calls_are_built_where_they_can_be():
    """The canary of the skips above: where Python's headers exist the build has the fast
    calls, and every op in `FAST_OPS` is called through its own (a build or load that lost
    them only logs a warning and falls back to the op calls)."""
    build = kernels._build(kernels.loaded_isa())
    if _python_headers() is None:
        assert not build.fast_calls
        pytest.skip(f"no Python.h in {sysconfig.get_paths()['include']}: no fast calls")
    assert build.fast_calls and "-DEMBER_FAST_CALLS" in build.command
    ops = {name: getattr(torch.ops.ember_cpu, name).default for name in kernels.FAST_OPS}
    assert set(kernels._fast_calls) == set(ops)
    lost = [name for name, call in kernels._fast_calls.items() if call is ops[name]]
    assert not lost, f"ops called without their fast calls: {lost}"


def _group_args(rows: int = 3, n: int = 45, k: int = 64, bias: bool = True):
    from ember.model.layers.group import GroupLinear, quantize_groups

    g = torch.Generator().manual_seed(rows * 100 + n)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    linear = GroupLinear.from_row_chunks(n, 4, [quantize_groups(w, 4, False)], b)
    x = torch.randn(2, rows, k, generator=g)
    return x, linear.codes, linear.scales, linear.mins, linear.bias, n, 4


def _linear_cases():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 67, generator=g), torch.randn(45, 67, generator=g), None
    packed = torch.ops.ember_cpu.pack_linear_weight(w.bfloat16())
    return {
        "group_linear": _group_args(),
        "packed_linear": (x, packed, None, torch.randn(45, generator=g), 45),
        "bf16_linear": (x, w.bfloat16(), b),
        "fp32_linear": (x.view(1, 5, 67), w, torch.randn(45, generator=g)),
    }


@pytest.mark.parametrize("name", ["group_linear", "packed_linear", "bf16_linear", "fp32_linear"])
def test_fast_linear_calls_equal_their_ops(name):
    args = _linear_cases()[name]
    want = getattr(torch.ops.ember_cpu, name).default(*args)
    got = _fast(name)(*args)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_fast_attention_call_equals_its_op(softcap):
    """Decodes, a prefill chunk (the C++ kernel hands it to the Python op
    `ember::paged_attention_rest`, taking the GIL the fast call dropped) and soft-capping
    (the whole call goes to the Python op)."""
    from benchmarks.attention_cases import make_case
    from ember.attention import torch_cpu  # noqa: F401  (registers ember::paged_attention_rest)

    args, _ = make_case([(30, 1), (0, 20), (70, 1)], seed=5)
    cache = args[3]
    args = (*args[:3], cache.clone(), *args[4:9], 0, softcap, True)
    want = torch.ops.ember_cpu.paged_attention.default(*args)
    want_cache = args[3].clone()
    args[3].copy_(cache)
    got = _fast("paged_attention")(*args)
    assert torch.equal(got, want)
    assert torch.equal(args[3], want_cache)  # the step's K/V written in place, as by the op


def test_fast_calls_raise_what_the_ops_raise():
    x, codes, scales, mins, bias, n, _ = _group_args()
    fast = _fast("group_linear")
    with pytest.raises(RuntimeError, match="bits must be 4, 5, 6 or 8, got 7"):
        fast(x, codes, scales, mins, bias, n, 7)
    with pytest.raises(RuntimeError, match="x has 63 features"):
        fast(x[..., :63].contiguous(), codes, scales, mins, bias, n, 4)
    with pytest.raises(OverflowError):
        fast(x, codes, scales, mins, bias, 2**70, 4)
    # Arguments it does not read go to the op, which raises its own error.
    with pytest.raises(RuntimeError, match="missing value for argument 'bits'"):
        fast(x, codes, scales, mins, bias, n)
    with pytest.raises((RuntimeError, TypeError)):
        fast(x, codes, scales, mins, bias, n, "4")


def test_tensor_subclasses_go_to_the_op():
    """A tensor subclass may override torch functions: it never takes the direct path."""
    calls = []

    class Traced(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    args = _group_args()
    want = torch.ops.ember_cpu.group_linear.default(*args)
    got = _fast("group_linear")(args[0].as_subclass(Traced), *args[1:])
    assert calls and torch.equal(got.as_subclass(torch.Tensor), want)


def test_fast_calls_release_the_gil():
    """Another Python thread runs while a fast call's kernel does (as with ATen's ops). The
    switch interval is raised so that this thread never hands the GIL over by itself: the
    other thread can only run while the call has dropped it."""
    import sys
    import threading
    import time

    x, codes, scales, mins, bias, n, bits = _group_args(rows=64, n=4096, k=4096)
    fast = _fast("group_linear")
    ticks = 0
    done = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0)

    # The kernel runs on one thread so that the ticking thread has a core to wake up on: with
    # every core in the kernel, a fast machine can finish it before the scheduler runs the
    # waiting thread, which then finds the GIL taken back. Calls are repeated for the same
    # reason; a call that kept the GIL would leave `ticks` where it was however often it ran.
    interval, threads = sys.getswitchinterval(), torch.get_num_threads()
    thread = threading.Thread(target=tick)
    sys.setswitchinterval(100.0)
    torch.set_num_threads(1)
    try:
        thread.start()
        before = ticks
        for _ in range(20):
            fast(x, codes, scales, mins, bias, n, bits)
            if ticks > before:
                break
        during = ticks - before
    finally:
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)
        done.set()
        thread.join()
    assert during > 0


def test_compiled_graphs_call_the_fast_calls():
    """Inductor's wrapper code names the op's fast call, and the graph gives the op's result."""
    from torch._inductor.utils import run_and_get_code

    _fast("group_linear")
    kernels.install_fast_calls()
    x, codes, scales, mins, bias, n, bits = _group_args()

    def step(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.ember_cpu.group_linear(x * 2, codes, scales, mins, bias, n, bits)
        return torch.relu(y)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    got, codes_out = run_and_get_code(compiled, x)
    wrapper = "\n".join(codes_out)
    assert "extern_kernels.ember_cpu_group_linear(" in wrapper
    assert "= torch.ops.ember_cpu.group_linear.default(" not in wrapper
    assert torch.equal(got, step(x))


_COMPILE_IN_CHILD = """
import sys, torch
from ember import kernels
from torch._inductor.utils import run_and_get_code
kernels.load()
if sys.argv[1] == "1":
    kernels.install_fast_calls()
w = torch.ops.ember_cpu.pack_linear_weight(torch.ones(8, 16))

def step(x):
    return torch.relu(torch.ops.ember_cpu.packed_linear(x * 2, w, None, None, 8))

x = torch.ones(3, 16)
got, code = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=False), x)
assert torch.equal(got, step(x))
print("fast" if "extern_kernels.ember_cpu_packed_linear(" in "\\n".join(code) else "op")
"""


def _compile_in_child(cache_dir: str, fast: bool) -> str:
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_IN_CHILD, "1" if fast else "0"],
        env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()[-1]


def test_graphs_compiled_with_fast_calls_stay_out_of_other_processes_caches(tmp_path):
    """Inductor's cache keys do not see the codegen hook: a graph compiled with the fast calls
    and cached must not be loaded by a process that has not installed them (their names are
    missing from its `extern_kernels`)."""
    _fast("packed_linear")
    assert _compile_in_child(str(tmp_path), True) == "fast"
    assert _compile_in_child(str(tmp_path), False) == "op"


@pytest.mark.slow  # two more processes (~16 s); a graph with op calls would only run slower
def test_graphs_compiled_without_fast_calls_stay_out_of_fast_processes_caches(tmp_path):
    _fast("packed_linear")
    assert _compile_in_child(str(tmp_path), False) == "op"
    assert _compile_in_child(str(tmp_path), True) == "fast"


def test_fast_calls_that_fail_to_load_leave_the_op_calls(monkeypatch, caplog):
    """The fast calls are optional: a library without them (or that fails to hand them over)
    keeps the kernels loaded and graphs calling the ops."""
    build = kernels._build(kernels.loaded_isa())

    def broken(path):
        raise OSError("no such symbol")

    monkeypatch.setattr(kernels.ctypes, "PyDLL", broken)
    with caplog.at_level("WARNING", logger="ember"):
        calls = kernels._load_fast_calls(build)
    assert calls == {n: getattr(torch.ops.ember_cpu, n).default for n in kernels.FAST_OPS}
    assert "fast kernel calls failed to load" in caplog.text
    without = build._replace(fast_calls=False)
    assert kernels._load_fast_calls(without) == calls
