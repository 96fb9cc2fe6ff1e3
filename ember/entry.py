"""The `ember` command. A command that loads a model starts ember's one-time kernel build
(`ember.kernels.prebuild`, about 15 s on a new machine) before it imports the rest of ember
(about 3 s), then runs `ember.cli`: the build overlaps the imports and the model's loading."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from ember.host.isa import CPU_ISAS

# Commands that load a model in this process (`bench` may start itself again under the AVX2
# environment first, and a process replacing itself must not leave a build half-done).
_MODEL_COMMANDS = ("generate", "embed", "warmup", "serve", "chat")


def _cpu_isa(args: Sequence[str]) -> str:
    """`--cpu-isa` as the command's own parser reads it (argparse, so `--cpu-isa=x` and
    abbreviations such as `--cpu x` too): the build started here must be the one it loads."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--cpu-isa", default="native")
    return parser.parse_known_args(args)[0].cpu_isa


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _MODEL_COMMANDS and "-h" not in args and "--help" not in args:
        isa = _cpu_isa(args[1:])
        if isa in CPU_ISAS:
            from ember import kernels

            kernels.prebuild(isa)
    from ember.cli import main as cli_main

    code = cli_main(args)
    if argv is None:  # the `ember` command itself: nothing runs after it in this process
        _exit_now(code)
    return code


def _exit_now(code: int | None) -> NoReturn:
    """Exit as the interpreter would (non-daemon threads joined, `atexit` functions run,
    standard streams flushed), without tearing down every module and object: that teardown
    walks everything torch, transformers and sympy built at import, 0.8-0.9 s of a 5 s
    `ember generate` on the default model (measured on a 2-core Intel Xeon: 4.89-5.05 s ->
    4.09-4.17 s), to free memory the OS takes back anyway."""
    shutdown = getattr(threading, "_shutdown", None)  # CPython's own first step of exiting
    if shutdown is None:
        sys.exit(code)
    # Its exit hooks (a ThreadPoolExecutor's, which tells idle workers to stop), then it joins
    # every non-daemon thread.
    shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing more to say there
            stream.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    sys.exit(main())
