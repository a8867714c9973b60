"""The house rules as tests over treeattn_lab/ and kernels/ (which installs as treeattn_lab.kernels).

- no import cycle among treeattn_lab modules through module-level imports (imports inside functions run
  late and may close a loop; they are graphed separately and must still name modules that exist);
- no library module over 500 lines, no file in kernels/ over 700;
- no function over 80 lines (``end_lineno - lineno + 1``, decorators excluded).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_ROOTS = {"treeattn_lab": ROOT / "treeattn_lab", "treeattn_lab.kernels": ROOT / "kernels"}
MODULE_LINES = 500
KERNEL_FILE_LINES = 700
FUNCTION_LINES = 80


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    top_level: list[tuple[str, int]] = field(default_factory=list)  # (imported module, line)
    in_functions: list[tuple[str, int]] = field(default_factory=list)


def discover() -> dict[str, Module]:
    modules = {}
    for prefix, folder in PACKAGE_ROOTS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            dotted = ".".join((prefix, *(parts[:-1] if is_package else parts)))
            if prefix == "treeattn_lab" and parts[0] == "kernels":
                continue  # a link to kernels/ in some checkouts; the real files are read above
            modules[dotted] = Module(dotted, path, is_package, ast.parse(path.read_text(), str(path)))
    return modules


MODULES = discover()


def defined_names(tree: ast.Module) -> set[str] | None:
    """Names bound at module level (None: anything, the module has ``__getattr__`` or a star import)."""
    names: set[str] = set()
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
            stack += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            stack += [s for h in getattr(node, "handlers", []) for s in h.body]
    return names


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def resolve(module: Module, node: ast.ImportFrom | ast.Import) -> list[tuple[str, str | None]]:
    """``(module, name)`` pairs an import statement reads: ``name`` is None for ``import x.y`` and
    for ``from x import y`` where ``y`` is itself a module."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    if node.level:
        base = module.name.split(".")
        base = base if module.is_package else base[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [(f"{target}.{a.name}", None) if f"{target}.{a.name}" in MODULES else (target, a.name)
            for a in node.names]


def collect_imports() -> None:
    for module in MODULES.values():
        function_nodes = set()
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                function_nodes |= {id(n) for n in ast.walk(node) if n is not node}
            if isinstance(node, ast.If) and is_type_checking(node):
                function_nodes |= {id(n) for n in ast.walk(node)}  # typing only: never executed
        for node in ast.walk(module.tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target, _ in resolve(module, node):
                if target.startswith("treeattn_lab"):
                    where = module.in_functions if id(node) in function_nodes else module.top_level
                    where.append((target, node.lineno))


collect_imports()


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
            if len(component) > 1 or v in edges.get(v, ()):
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def graph(*, with_functions: bool) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module in MODULES.values():
        found = module.top_level + (module.in_functions if with_functions else [])
        edges[module.name] = {t for t, _ in found if t in MODULES and t != module.name}
    return edges


def test_no_import_cycles_through_module_level_imports():
    cycles = find_cycles(graph(with_functions=False))
    assert not cycles, "import cycles (module-level imports):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_every_treeattn_lab_import_names_something_that_exists():
    """Top-level and function-level imports alike: a move that leaves a stale import fails here."""
    missing = []
    for module in MODULES.values():
        for node in ast.walk(module.tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target, name in resolve(module, node):
                if not target.startswith("treeattn_lab"):
                    continue
                if target not in MODULES:
                    missing.append(f"{module.path.relative_to(ROOT)}:{node.lineno}: no module {target}")
                elif name is not None and (names := defined_names(MODULES[target].tree)) is not None \
                        and name not in names:
                    missing.append(f"{module.path.relative_to(ROOT)}:{node.lineno}: {target} has no {name}")
    assert not missing, "\n".join(missing)


def test_the_graph_sees_real_imports():
    """Guards the tests above against a graph that is empty because it resolves nothing."""
    edges = graph(with_functions=False)
    assert "treeattn_lab.ops" in edges["treeattn_lab"]
    assert "treeattn_lab.ops.backends" in edges["treeattn_lab.ops.tree"]
    late = graph(with_functions=True)["treeattn_lab.ops.tree"]
    assert "treeattn_lab.kernels.tree_attention" in late - edges["treeattn_lab.ops.tree"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_library_module_over_500_lines():
    long = [f"{m.path.relative_to(ROOT)}: {n} lines" for m in MODULES.values()
            if not m.name.startswith("treeattn_lab.kernels") and (n := line_count(m.path)) > MODULE_LINES]
    assert not long, f"modules over {MODULE_LINES} lines:\n" + "\n".join(long)


def test_no_kernel_file_over_700_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / "kernels").rglob("*.py"))
            if (n := line_count(p)) > KERNEL_FILE_LINES]
    assert not long, f"kernels/ files over {KERNEL_FILE_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("folder", ["treeattn_lab", "kernels"])
def test_no_function_over_80_lines(folder):
    long = []
    for module in MODULES.values():
        if not module.path.is_relative_to(ROOT / folder):
            continue
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > FUNCTION_LINES:
                    long.append(f"{module.path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {FUNCTION_LINES} lines:\n" + "\n".join(long)
