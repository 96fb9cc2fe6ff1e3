"""The package layout's rules (the style guide's section 1): every module opens with a docstring
saying what it owns, and no two ember modules import each other, directly or around a cycle,
counting imports made inside functions (those under `if TYPE_CHECKING:` run never and do not
count)."""

from __future__ import annotations

import ast
import os

import ember

ROOT = os.path.dirname(os.path.abspath(ember.__file__))


def _modules() -> dict[str, str]:
    """ember's modules: dotted name -> path."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return skip


def _imports(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The ember modules `module` imports when it runs (at its top or in any function)."""
    tree = ast.parse(open(path).read())
    skip = _type_checking_only(tree)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            # the deepest ember module the name is or lies in
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan's algorithm)."""
    # Tarjan's strongly connected components: any with two or more modules is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_layout_no_import_cycles():
    assert _cycles(_graph()) == []


def test_layout_finds_a_cycle_when_there_is_one():
    """Canaries for the test above: the walk sees imports inside functions, and a cycle through
    three modules is found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    modules = _modules()
    imports = _imports("ember.runtime.engine", modules["ember.runtime.engine"], modules)
    assert "ember.runtime.scheduler" in imports
    assert "ember.model.loader" in imports
    imports = _imports("ember.model.loader", modules["ember.model.loader"], modules)
    assert "ember.model.gguf.load" in imports  # imported inside `load_model`


def test_layout_every_module_says_what_it_owns():
    missing = []
    for module, path in _modules().items():
        tree = ast.parse(open(path).read())
        doc = ast.get_docstring(tree)
        if not doc or len(doc.split()) < 4:
            missing.append(module)
    assert missing == []
