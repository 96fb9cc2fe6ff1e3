"""Imports flow one way: entry -> cli/tools -> runtime -> compile -> model -> attention, lora, kernels
-> host, version, errors, keys. No module imports a layer above its own, at module level or inside a function."""

from __future__ import annotations

import ast
import pathlib

import ember

ROOT = pathlib.Path(ember.__file__).parent

# Higher number = higher layer; a module may import only its own layer or lower ones.
LAYERS = {
    "ember.host": 0,
    "ember.version": 0,
    "ember.errors": 0,
    "ember.keys": 0,
    "ember.kernels": 1,
    "ember.attention": 2,
    "ember.lora": 2,
    "ember.model": 3,
    "ember.compile": 4,
    "ember.runtime": 5,
    "ember": 6,  # the public API (__init__)
    "ember.tools": 7,
    "ember.cli": 8,
    "ember.entry": 9,  # the `ember` command: starts the kernel build, then runs the CLI
}


def _layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in LAYERS:
            return LAYERS[name]
    raise AssertionError(f"{module} is in no layer")


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from ember import kernels` imports ember.kernels; `from ember.x import y`, ember.x.
            if node.module == "ember":
                names += [f"ember.{a.name}" for a in node.names]
            else:
                names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n == "ember" or n.startswith("ember.")]


def test_imports_flow_down_the_layers():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        for imported in _imports(ast.parse(path.read_text())):
            if _layer(imported) > _layer(module):
                wrong.append(f"{module} imports {imported}")
    assert not wrong, "\n".join(wrong)
