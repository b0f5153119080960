"""The package's shape: imports run one way, and each engine loads only its own cluster code."""

import ast
import pathlib
import sys

import pytest

from conftest import REPO, run

PACKAGE = REPO / "tpu_keras"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, modules: set) -> set:
    """The toolkit modules `path` imports, at its top or inside any function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from a.b import c` takes the module a.b.c if there is one, else a name of a.b.
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                     else node.module for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def import_graph() -> dict:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(paths)) - {name} for name, path in paths.items()}


def cycles(graph: dict) -> list:
    """Groups of nodes that reach each other (Tarjan's strongly connected components)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    """tpu_keras.training.run -> tpu_keras.training; top-level modules stand for themselves."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_no_package_imports_one_that_imports_it_back():
    graph = {}
    for module, targets in import_graph().items():
        graph.setdefault(package_of(module), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(module))
    assert cycles(graph) == []


CONNECT = """
import sys, tpu_keras
tpu_keras.connect({{}}, engine={engine!r})
print("LOADED", sorted(m for m in sys.modules if m.startswith("tpu_keras.")))
"""


@pytest.mark.parametrize("engine, absent", [("jax", "tpu_keras.cluster.tf_engine"),
                                            ("tf", "tpu_keras.cluster.jax_engine")])
def test_connect_loads_only_its_own_engine(engine, absent):
    output = run([sys.executable, "-c", CONNECT.format(engine=engine)]).stdout
    loaded = eval(output.split("LOADED ", 1)[1].splitlines()[0])
    assert f"tpu_keras.cluster.{engine}_engine" in loaded
    assert absent not in loaded, loaded


def test_the_parallelism_package_imports_nothing_from_the_training_loop():
    code = ("import os, sys; os.environ['KERAS_BACKEND'] = 'jax'\n"
            "import tpu_keras.parallelism.distribution, tpu_keras.parallelism.mesh\n"
            "print('LOADED', sorted(m for m in sys.modules if m.startswith('tpu_keras.')))")
    loaded = eval(run([sys.executable, "-c", code]).stdout.split("LOADED ", 1)[1].splitlines()[0])
    assert "tpu_keras.parallelism.rules" in loaded
    assert not [m for m in loaded if m.startswith(("tpu_keras.training", "tpu_keras.models"))], loaded
