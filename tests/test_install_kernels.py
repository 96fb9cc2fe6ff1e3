"""The package build builds ember's C++ kernels for this machine (`setup.py`), outside pip's
build isolation, so the first run after an install compiles nothing; without torch in the
target environment, or with `EMBER_SKIP_KERNEL_BUILD=1`, the install goes on without them."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys

import pytest

from ember import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_module():
    spec = importlib.util.spec_from_file_location("ember_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not as __main__: defines, does not run setup()
    return module


def test_the_package_build_builds_the_kernels_this_process_loads(monkeypatch, capsys, tmp_path):
    """Under pip's isolation (its PYTHONPATH and PYTHONNOUSERSITE) the step still reaches the
    environment's torch and builds the library `ember.kernels` loads (this session's cache
    holds it already, so the step finds it built). On the AVX2 host, the AVX2 build."""
    if not kernels.available():
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "isolated-build-env"))
    monkeypatch.setenv("PYTHONNOUSERSITE", "1")
    _setup_module().build_kernels()
    out = capsys.readouterr().out
    isa = kernels._default_isa()  # the one an engine on this host loads
    assert f"ember: C++ kernels built for cpu_isa={isa!r}" in out, out
    assert os.path.exists(kernels._build(isa).library)


def test_without_torch_or_when_skipped_the_install_goes_on(monkeypatch, capsys, tmp_path):
    setup = _setup_module()
    python = tmp_path / "python-without-site-packages"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(python))
    setup.build_kernels()
    assert "torch is not installed yet" in capsys.readouterr().out
    monkeypatch.setenv("EMBER_SKIP_KERNEL_BUILD", "1")
    setup.build_kernels()
    assert capsys.readouterr().out == ""


def test_without_a_compiler_the_engine_says_so_and_runs_eagerly_on_the_fallbacks(
    checkpoint_dir, tmp_path
):
    """No C++ compiler (CXX names none, a fresh cache): one message for ember's kernels, one
    for compiled graphs, and the engine answers on the eager path with the PyTorch fallbacks,
    the same greedy tokens as an engine with everything."""
    from ember import LLM, SamplingParams

    d = checkpoint_dir("tiny-llama")
    code = (
        "import json, sys\n"
        "from ember import LLM, SamplingParams, kernels\n"
        "llm = LLM(model=sys.argv[1], kv_cache_gib=0.01, use_tqdm=False)\n"
        "out = llm.generate({'prompt_token_ids': [5, 6, 7]}, SamplingParams(max_tokens=6, "
        "temperature=0), use_tqdm=False)[0].outputs[0].token_ids\n"
        "print(json.dumps([llm.llm_engine.config.compile, kernels.available(), out]))\n"
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", code, d], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled, kernels_here, tokens = json.loads(done.stdout.splitlines()[-1])
    assert not compiled and not kernels_here
    assert "compile=True needs a C++ compiler" in done.stderr
    assert done.stderr.count("cannot build ember's C++ kernels: no C++ compiler") == 1
    with LLM(model=d, kv_cache_gib=0.01, compile=False, use_tqdm=False) as llm:
        want = llm.generate(
            {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6, temperature=0),
            use_tqdm=False,
        )[0].outputs[0].token_ids  # fmt: skip
    assert tokens == want
