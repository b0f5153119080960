"""The package's shape: imports run one way, and each engine loads only its own cluster code;
the README is a front door, and every relative link in it and in the guides leads somewhere."""

import ast
import pathlib
import re
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


# ----- the README and the guides ------------------------------------------------------

README = REPO / "README.md"
DOCUMENTS = [README] + sorted((REPO / "docs").glob("*.md"))


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move reference text to docs/"
    first = next(i for i, line in enumerate(lines, 1) if "python -m tpu_keras.train" in line)
    assert first <= 60, f"the first train command is on line {first} of README.md"


def outside_code(text: str) -> list:
    """The lines of a markdown text outside fenced code blocks, inline code spans removed."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return kept


def anchors(text: str) -> set:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped,
    spaces as hyphens, a repeated heading numbered -1, -2, ..."""
    found, seen = set(), {}
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6} +(.*?) *#*$", line)
        if fenced or not heading:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link's text alone
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(document):
    text = document.read_text()
    assert "../shared" not in text, f"{document.name} cites ../shared: the repository stands alone"
    broken = []
    for line in outside_code(text):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (document.parent / path).resolve() if path else document
            if not linked.exists():
                broken.append(f"{target}: no file {path}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
                broken.append(f"{target}: no heading in {linked.name} gives #{anchor}")
    assert not broken, f"{document.name}: " + "; ".join(broken)
