"""The `ember` command. A command that loads a model starts ember's one-time kernel build
(`ember.kernels.prebuild`, about 15 s on a new machine) before it imports the rest of ember
(about 3 s), then runs `ember.cli`: the build overlaps the imports and the model's loading."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ember.host import CPU_ISAS

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

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
