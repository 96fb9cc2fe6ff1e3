"""Tests that need ember's C++ kernels skip only where there is no C++ compiler at all (the
command the kernel build runs: `$CXX`, else `c++`) and no build of them to load; where there is
one, a build that fails is a test failure with the compiler's output, never a skip
(`kernels.available()` is False on a broken build too: a skip on it hid one)."""

from __future__ import annotations

import shutil

import pytest

from ember import kernels


def compiler() -> str:
    """The compiler command ember's kernel build runs (`$CXX`, else `c++`)."""
    return kernels._build(kernels._default_isa()).command[0]


def has_compiler() -> bool:
    return shutil.which(compiler()) is not None


def _no_kernels() -> bool:
    """No compiler, and no build of the kernels already made to load."""
    return not has_compiler() and not kernels.available()


_REASON = f"no C++ compiler ({compiler()!r} not found) and no kernels built"

# A module's `pytestmark`: skip where the kernels cannot be had at all.
needs_compiler = pytest.mark.skipif(_no_kernels(), reason=_REASON)


def require_kernels() -> None:
    """Inside a test: skip where the kernels cannot be had at all, else build and load them (a
    failed build raises, naming the build and the compiler's output)."""
    if _no_kernels():
        pytest.skip(_REASON)
    kernels.load()
