"""The suite's two hosts (tests/host_isa.py): a test that assumes native bf16 fails in its
[avx2-host] run, on any CPU with more than AVX2, with its own traceback."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from ember.host.isa import beyond_avx2

ROOT = pathlib.Path(__file__).parents[1]

_PROBE = """
from ember.host.isa import cpu_has_native_bf16, host_isa


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


def test_the_switch_refuses_a_bad_value(monkeypatch):
    from ember.host import isa as host

    monkeypatch.setenv("EMBER_CPU_ISA", "avx3")
    host.host_isa.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"EMBER_CPU_ISA must be one of \('native', 'avx2'\)"):
            host.host_isa()
    finally:
        monkeypatch.undo()
        host.host_isa.cache_clear()


_LATE = """
import os, torch
print(torch.backends.cpu.get_cpu_capability())  # ATen chooses its kernels here
os.environ["EMBER_CPU_ISA"] = "avx2"
from ember import EngineArgs
from ember.host import isa as host
assert not host.cpu_has_native_bf16() and host.resolve_isa("native") == "avx2"
try:
    host.check_host_isa()
except ValueError as e:
    print("refused:", e)
"""


@pytest.mark.one_host("it sets the switch itself")
def test_a_switch_set_after_aten_chose_its_kernels_is_refused():
    """Set after ATen's first kernel, the switch cannot cap ATen: engines refuse to start,
    naming what to do, rather than run ATen's wider kernels under an AVX2-only host's rules."""
    if not beyond_avx2():
        pytest.skip("ATen's kernels are AVX2 at most here: nothing to refuse")
    env = dict(os.environ)
    for name in ("EMBER_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        env.pop(name, None)
    run = subprocess.run(
        [sys.executable, "-c", _LATE], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    capability = run.stdout.splitlines()[0]
    if capability in ("AVX2", "DEFAULT", "NO AVX"):  # AVX-VNNI without AVX-512, say
        pytest.skip("ATen's own choice here is AVX2 at most: nothing to refuse")
    assert f"refused: EMBER_CPU_ISA=avx2: ATen already runs its {capability}" in run.stdout
    assert "set EMBER_CPU_ISA=avx2 in the environment before Python starts" in run.stdout
