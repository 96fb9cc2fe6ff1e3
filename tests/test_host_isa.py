"""The suite's two hosts (tests/host_isa.py): a test that assumes native bf16 fails in its
[avx2-host] run, on any CPU with more than AVX2, with its own traceback."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from ember.host import beyond_avx2

ROOT = pathlib.Path(__file__).parents[1]

_PROBE = """
from ember.host import cpu_has_native_bf16, host_isa


def test_assumes_native_bf16():
    assert cpu_has_native_bf16(), host_isa()


def test_any_cpu():
    assert sum(range(4)) == 6
"""


@pytest.mark.one_host("it runs both hosts itself")
def test_an_expectation_of_native_bf16_fails_on_the_avx2_host(tmp_path):
    if not beyond_avx2():
        pytest.skip("this CPU has nothing past AVX2: its own run is the AVX2-only host's")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.host_isa"]\n')
    (tmp_path / "test_probe.py").write_text(_PROBE)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("EMBER_CPU_ISA", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_probe.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout
    assert run.returncode == 1, out[-3000:]
    # Auto-detected (the source names native bf16) and run as an AVX2-only host in the child,
    # whose traceback comes back; a test naming no ISA runs once.
    assert "FAILED test_probe.py::test_assumes_native_bf16[avx2-host]" in out, out[-3000:]
    assert "assert False" in out and "avx2" in out
    assert "PASSED test_probe.py::test_any_cpu\n" in out
    assert "test_any_cpu[" not in out
