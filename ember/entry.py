"""The `ember` command. A command that loads a model starts ember's one-time kernel build
(`ember.kernels.prebuild`, about 15 s on a new machine) before it imports the rest of ember
(about 3 s), then runs `ember.cli`: the build overlaps the imports and the model's loading."""

from __future__ import annotations

import sys
from collections.abc import Sequence

# Commands that load a model in this process (`bench` may start itself again under the AVX2
# environment first, and a process replacing itself must not leave a build half-done).
_MODEL_COMMANDS = ("generate", "embed", "warmup", "serve")


def _flag(args: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _MODEL_COMMANDS and "-h" not in args and "--help" not in args:
        isa = _flag(args, "--cpu-isa") or "native"
        if isa in ("native", "avx2"):
            from ember import kernels

            kernels.prebuild(isa)
    from ember.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
