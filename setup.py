"""The package build, plus one step: ember's C++ kernels are built here for this machine, so a
user's first run compiles nothing (#52).

The kernels compile against the torch that will run them, and pip builds packages in an isolated
environment that hides it (a build requirement on torch would have pip fetch another torch, a
CUDA one from PyPI's default index). So the step runs ember's own kernel build
(`ember.kernels.load`, which keys the library by sources, flags, CPU target and torch version
and writes it to the user cache) in this interpreter outside the isolation: where torch is
installed already, the first run finds the library built. Where it is not yet (a fresh
environment, torch installed by the same `pip install`), or where no C++ compiler exists, the
step says so and the install goes on: the kernels then build on first use, or ember runs its
PyTorch fallbacks. `EMBER_SKIP_KERNEL_BUILD=1` skips the step.
"""

from __future__ import annotations

import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

_BUILD = """
import sys
try:
    import torch  # noqa: F401
except ImportError:
    print("ember: torch is not installed yet; ember's C++ kernels will build on first use")
    sys.exit(0)
from ember import kernels
try:
    kernels.load()
except RuntimeError as e:
    print(f"ember: C++ kernels not built ({e}); they build on first use, or ember runs its "
          "PyTorch fallbacks where no compiler exists")
    sys.exit(0)
print(f"ember: C++ kernels built for cpu_isa={kernels.loaded_isa()!r}")
"""


def build_kernels() -> None:
    if os.environ.get("EMBER_SKIP_KERNEL_BUILD", "0") not in ("", "0"):
        return
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    env["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__))  # these sources
    try:
        done = subprocess.run(
            [sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True, timeout=900
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"ember: C++ kernels not built at install ({e}); they build on first use")
        return
    print((done.stdout + done.stderr).strip()[-2000:])


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        build_kernels()


if __name__ == "__main__":  # as setuptools' build backend runs it (tests import it too)
    setup(cmdclass={"build_py": BuildPyWithKernels})
