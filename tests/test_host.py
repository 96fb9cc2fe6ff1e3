"""The trust boundary of the caches ember loads code from, and the exact CPU target in keys."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from ember import host, kernels


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_private_dir_creates_0700_and_refuses_dirs_others_can_write(tmp_path, caplog):
    os.chmod(tmp_path, 0o755)
    made = host.private_dir(str(tmp_path / "cache" / "kernels"), "kernel cache")
    assert made is not None and _mode(made) == 0o700
    assert host.private_dir(made, "kernel cache") == made  # idempotent

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert host.private_dir(str(shared), "compile cache") is None
    assert f"not using compile cache {shared}: it is writable by group or others" in caplog.text

    # A private dir under a parent anyone may write to (and that is not sticky, as /tmp is)
    # can be swapped for someone else's.
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    assert host.private_dir(str(loose / "inner"), "compile cache") is None
    os.chmod(loose, 0o1777)
    assert host.private_dir(str(loose / "inner"), "compile cache") == str(loose / "inner")


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_private_dir_refuses_a_dir_owned_by_another_user(tmp_path, caplog):
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, 4242, -1)
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert host.private_dir(str(other), "kernel cache") is None
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


def test_cpu_target_is_the_exact_march_expansion():
    native = host.cpu_target()
    assert native == host.cpu_target("-march=native")  # stable
    v3 = host.cpu_target("-march=x86-64-v3")
    assert v3.startswith("x86-64-v3-") and v3 != native
