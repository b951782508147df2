"""The package's layout is its architecture: imports only go down the layers, and never cycle.

Every import counts, including the ones inside functions: a cycle hidden in a function body is
still a cycle.
"""

import ast
from pathlib import Path

import pytest

import specheads

PACKAGE = Path(specheads.__file__).parent


def module_name(path: Path) -> str:
    parts = ["specheads", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The specheads modules that module `name` imports (anywhere in its body)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            # `from pkg import sub` imports the submodule; `from mod import name` the module
            candidates = [f"{source}.{alias.name}" for alias in node.names] + [source]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                found.add(candidate)
                break
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return 0  # specheads/__init__.py: the version and this list, nothing else
    for rank, layer in enumerate(specheads.LAYERS):
        if parts[1] in layer:
            return rank
    raise AssertionError(f"{module} belongs to no layer in specheads.LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in graph.items()
        for b in targets
        if layer_of(b) > layer_of(a)
    )


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [m0, m1, ..., m0], or [] when the graph is acyclic (iterative DFS)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return []


def test_every_module_belongs_to_a_layer():
    for module in package_modules():
        layer_of(module)


def test_imports_only_go_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle == [], "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    # heads/io.py imports the registry at module level; export/load.py imports heads relatively
    assert "specheads.heads.registry" in graph["specheads.heads.io"]
    assert "specheads.heads" in graph["specheads.export.load"]
    assert len(graph) > 40 and sum(map(len, graph.values())) > 100


@pytest.mark.parametrize(
    "extra, expect",
    [
        ({"specheads.target": {"specheads.heads.spec"}}, "upward"),  # a lower layer importing a higher
        ({"specheads.decode.tree": {"specheads.decode.drafters"}}, "cycle"),  # drafters imports tree
    ],
)
def test_the_checks_fail_on_a_bad_graph(extra, expect):
    graph = {k: set(v) for k, v in import_graph().items()}
    for module, targets in extra.items():
        graph[module] |= targets
    if expect == "upward":
        assert upward_imports(graph)
    else:
        assert find_cycle(graph)[0] == find_cycle(graph)[-1]
        assert "specheads.decode.tree" in find_cycle(graph)
