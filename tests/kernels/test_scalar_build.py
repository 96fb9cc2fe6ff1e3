"""The kernels' scalar paths: what `-march=native` builds on an x86 CPU without AVX2 + FMA.

The kernel and attention tests, and the int8 and GGUF tests that hold the quantized linears
to integer references and HF (`REFERENCE_TESTS`), run in a child pytest whose ember kernels
are built for baseline x86-64 (`EMBER_KERNELS_NO_SIMD=1`). ATen and inductor keep this CPU's
vectors in the child, so it gets an inductor cache of its own: torch's FX graph cache keys a
graph without the vector ISA, and the child's 16-channel panels give the same graph shapes as
an AVX2 process's. Sharing the cache served the child 8-lane inductor loops built with 16-lane
vectors, which corrupted the heap.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from ember import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Beyond tests/kernels (which packs and multiplies but does not reach Int8Linear's codes): the
# quantized linears against integer and dequantized references, GGUF blocks read and packed,
# and greedy decoding against HF on the same files.
REFERENCE_TESTS = [
    f"tests/e2e/{name}"
    for name in (
        "test_int8.py::test_int8_linear_matches_dequantised_reference",
        "test_int8.py::test_int8_activations_match_an_integer_reference",
        "test_int8.py::test_per_token_int8_matches_an_integer_reference",
        "test_gguf.py::test_gguf_greedy_matches_hf_on_the_same_file",
        "test_gguf.py::test_group_linear_from_blocks_reads_ggml_layouts_exactly",
        "test_gguf.py::test_the_kernels_pack_file_blocks_as_the_converters_do",
        "test_gguf.py::test_k_quants_are_kept_as_the_file_holds_them",
        "test_gguf.py::test_other_types_requantize_to_8_bit_groups_within_half_a_step",
    )
]


# Both scopes run under -m slow only: "kernels" (the kernels' own tests and the quantized
# linears' integer references: the scalar code of every kernel is reached) took 42 s of the
# default run's critical path on a 2-core Xeon, for a build no machine this project runs on
# uses (every x86 CPU checked here has AVX2 + FMA; the scalar code is what `-march=native`
# builds without them). "all" adds the attention tests and greedy decoding against HF on GGUF
# files (165 s).
SCOPES = {
    "kernels": [
        "tests/kernels/test_linears.py",
        "tests/kernels/test_row_max.py",
        *(t for t in REFERENCE_TESTS if "greedy" not in t),
    ],
    "all": ["tests/kernels", "tests/attention", *REFERENCE_TESTS],
}


@pytest.mark.one_host("it builds the kernels without SIMD itself")
@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="builds for baseline x86-64"
)
@pytest.mark.slow
@pytest.mark.parametrize("scope", ["kernels", "all"])
def test_kernel_tests_pass_on_the_scalar_build(tmp_path, scope):
    if os.environ.get(kernels.NO_SIMD_ENV) == "1":
        pytest.skip("this process is the scalar build's run")
    if not kernels.available():
        pytest.skip("ember's kernels cannot be built here (no C++ compiler)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update({kernels.NO_SIMD_ENV: "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    # The fused-projection test compiles (the graph's dedupe does not follow the kernels' ISA):
    # 15 s of inductor start-up in a child that compiles nothing else.
    skip = "not avx2-host" + (" and not fused_projections" if scope == "kernels" else "")
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-k", skip, *SCOPES[scope]]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    tail = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    # the child's build: baseline x86-64, 16-channel panels, no bf16 pairs
    probe = (
        "from ember import kernels; kernels.load(); "
        "print(kernels.panel_width(), kernels.bf16_pairs(), "
        "*kernels._build(kernels.loaded_isa()).command)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True
    )
    words = out.stdout.split()
    assert words[:2] == ["16", "False"] and "-march=x86-64" in words, out.stderr[-2000:]
