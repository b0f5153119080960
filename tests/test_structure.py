"""The package's shape: imports run one way, and each engine loads only its own cluster code;
a run's config is resolved in one step and every command is set up by one recipe, with
helpers written once; the README is a front door, and every relative link in it and in
the guides leads somewhere."""

import ast
import io
import pathlib
import re
import sys
import tokenize

import pytest

from conftest import REPO, run_command

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
    """tpu_keras.training.loop -> tpu_keras.training; top-level modules stand for themselves."""
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
    output = run_command([sys.executable, "-c", CONNECT.format(engine=engine)]).stdout
    loaded = eval(output.split("LOADED ", 1)[1].splitlines()[0])
    assert f"tpu_keras.cluster.{engine}_engine" in loaded
    assert absent not in loaded, loaded


def test_the_parallelism_package_imports_nothing_from_the_training_loop():
    code = ("import os, sys; os.environ['KERAS_BACKEND'] = 'jax'\n"
            "import tpu_keras.parallelism.distribution, tpu_keras.parallelism.mesh\n"
            "print('LOADED', sorted(m for m in sys.modules if m.startswith('tpu_keras.')))")
    loaded = eval(run_command([sys.executable, "-c", code]).stdout.split("LOADED ", 1)[1].splitlines()[0])
    assert "tpu_keras.parallelism.rules" in loaded
    assert not [m for m in loaded if m.startswith(("tpu_keras.training", "tpu_keras.models"))], loaded


# ----- the README and the guides ------------------------------------------------------

README = REPO / "README.md"
DOCUMENTS = [README] + sorted((REPO / "docs").glob("*.md"))


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move reference text to docs/"
    first = next(i for i, line in enumerate(lines, 1) if "python -m tpu_keras.train" in line)
    assert first <= 30, f"the first train command is on line {first} of README.md"


def test_the_configuration_reference_is_current_and_has_a_line_for_every_key():
    """docs/configuration.md's "Every key" is what scripts/config_reference.py writes from
    `defaults()` and its comments today, with a row for each key and part."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import config_reference
    finally:
        sys.path.remove(str(REPO / "scripts"))
    from tpu_keras.config import defaults
    document = (REPO / "docs" / "configuration.md").read_text()
    assert config_reference.written(document) == document, (
        "docs/configuration.md's reference is out of date: run python scripts/config_reference.py")
    rows = set(re.findall(r"^\| `([\w.]+)` \|", document, re.M))
    keys = set(config_reference._paths(defaults()))
    sections = {key for key in keys if "." not in key and config_reference._holds_keys(defaults()[key])}
    assert keys - sections <= rows, sorted(keys - sections - rows)


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


# ----- one resolved config, one setup, helpers written once ---------------------------

CONFIG_NAME = re.compile(r"(^|_)(config|cfg)$")  # config, cfg, model_config, train_cfg, ...
# Methods that change a ConfigDict in place.
MUTATORS = {"update", "setdefault", "pop", "popitem", "clear", "unlock", "unlocked",
            "__setattr__", "__setitem__", "__delattr__", "__delitem__"}


def _root(node):
    """The name an attribute or subscript chain starts from (`config` of config.train.x)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _inside_a_config(target, names, modules=()) -> bool:
    """Whether assigning to `target` writes into a config: its chain starts from a config
    name, or passes through an attribute named like one (run.config.train.x) and does not
    start from a module (jax.config is JAX's settings)."""
    if not isinstance(target, (ast.Attribute, ast.Subscript)):
        return False
    if _root(target) in names:
        return True
    if _root(target) in modules:
        return False
    node = target.value
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and CONFIG_NAME.search(node.attr):
            return True
        node = node.value
    return False


def config_writes(source: str) -> list:
    """(line, code) of each write into a config a function was given, in `source`.

    A function's config names are its parameters named like a config (`config`,
    `model_config`, `train_cfg`, ...) and the names it binds to a part of one
    (`train = config.train`); a name it binds to anything else (a copy, a new config)
    is its own to change. A write is an assignment to an attribute or item of one
    (`config.train.x = ...`, `train.x = ...`, `config.data["x"] = ...`), or a call
    of a method that changes it in place (`config.mesh.update(...)`), or `setattr`.
    Nested functions start from their enclosing function's names.
    """
    found, tree = [], ast.parse(source)
    modules = {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
               if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}

    def nodes_of(function):
        """The nodes of `function`'s body in source order; a nested function is one node."""
        stack, nodes = list(function.body), []
        while stack:
            node = stack.pop()
            if hasattr(node, "lineno"):
                nodes.append(node)
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                stack.extend(ast.iter_child_nodes(node))
        return sorted(nodes, key=lambda n: (n.lineno, n.col_offset))

    def visit(function, inherited):
        names = set(inherited) | {arg.arg for arg in ast.walk(function.args)
                                  if isinstance(arg, ast.arg) and CONFIG_NAME.search(arg.arg)}
        for node in nodes_of(function):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node, names)
            elif isinstance(node, ast.ClassDef):
                visit_class(node)
            elif isinstance(node, ast.Call):
                func = node.func
                if ((isinstance(func, ast.Attribute) and func.attr in MUTATORS
                     and (_root(func.value) in names or _inside_a_config(func, names, modules)))
                        or (isinstance(func, ast.Name) and func.id in ("setattr", "delattr")
                            and node.args and (_root(node.args[0]) in names
                                               or _inside_a_config(node.args[0], names, modules)))):
                    found.append((node.lineno, ast.unparse(node)[:100]))
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for target in targets:
                    for element in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                        if _inside_a_config(element, names, modules):
                            found.append((node.lineno, ast.unparse(element)))
                        elif isinstance(element, ast.Name) and isinstance(node, ast.Assign):
                            value = node.value
                            if (isinstance(value, (ast.Attribute, ast.Subscript, ast.Name))
                                    and _root(value) in names):
                                names.add(element.id)  # a part of a config it was given
                            else:
                                names.discard(element.id)  # a value of its own

    def visit_class(cls):
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(item, set())
            elif isinstance(item, ast.ClassDef):
                visit_class(item)

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            visit(node, set())
        elif isinstance(node, ast.ClassDef):
            visit_class(node)
    return found


def config_writes_in(package: pathlib.Path) -> dict:
    return {str(path.relative_to(package.parent)): writes for path in sorted(package.rglob("*.py"))
            if (writes := config_writes(path.read_text()))}


def test_the_rule_finds_the_ways_a_config_was_changed_in_place():
    old_writers = '''
def resolve(config, cluster):
    train = config.train
    train.precision = precision(train, cluster)
def prepare_preset(model_config, workdir):
    model_config.preset = model_config.preset.replace("{workdir}", workdir)
def text_resolve(config, workdir):
    config.data.token_counts = workdir
    config["data"]["vocabulary"] = ""
def load(config):
    config.mesh.update(data=1)
    setattr(config.cluster, "strategy", "one_device")
def later(run):
    run.config.train.steps += 1
def own(config):
    config = copy.deepcopy(config)
    config.train.steps = 1
    fresh = defaults()
    fresh.engine = "jax"
    text = config.data.name.replace("a", "b")
'''
    assert [line for line, _ in config_writes(old_writers)] == [4, 6, 8, 9, 11, 12, 14]


def test_no_module_changes_a_config_it_was_given():
    """The run's config is resolved in one step (`training.run_config`, which writes only
    into its own copy, then frozen); no other stage writes into a config it is handed."""
    assert config_writes_in(PACKAGE) == {}


def calls_in(path: pathlib.Path, function: str) -> set:
    """The callees (as written: `setup.set_up`) of the top-level `function` in `path`."""
    tree = ast.parse(path.read_text())
    [node] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    return {ast.unparse(call.func) for call in ast.walk(node) if isinstance(call, ast.Call)}


# Each command, from its entry to `training.setup.set_up`: (module, function, the call it makes).
SETUP = ("training/setup.py", "set_up")
TO_SETUP = {
    "train": [("training/loop.py", "train", "setup.set_up")],
    "evaluate": [("evaluate.py", "main", "evaluation.evaluate"),
                 ("training/evaluation.py", "evaluate", "setup.set_up")],
    "restore": [("training/restored.py", "load", "setup.set_up")],
    "export": [("export.py", "main", "restored.load"),
               ("training/restored.py", "load", "setup.set_up")],
    "generate": [("generate.py", "main", "generation.from_run"),
                 ("tools/generation.py", "from_run", "load"),
                 ("tools/generation.py", "load", "restored.load"),
                 ("training/restored.py", "load", "setup.set_up")],
}
# What only the setup does (or the resolving step, for the pieces of the resolved config).
SETUP_ONLY = {"open_checkpointer": "training/setup.py", "prepare_preset": "training/setup.py",
              "compile_cache.prepare": "training/setup.py", "compile_cache.enable": "training/setup.py",
              "keep_steps": "training/setup.py", "preset_copy.keep": "training/setup.py",
              "run_config.resolve": "training/setup.py", "preset_copy.use": "training/run_config.py",
              "text.resolve": "training/run_config.py", "hub.expand_preset": "training/run_config.py"}


@pytest.mark.parametrize("command", sorted(TO_SETUP))
def test_every_command_that_runs_a_model_is_set_up_by_the_one_setup(command):
    for module, function, call in TO_SETUP[command]:
        assert call in calls_in(PACKAGE / module, function), (command, module, function, call)


def test_the_steps_of_a_setup_are_taken_nowhere_else():
    callers = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for call in ast.walk(ast.parse(path.read_text())):
            if isinstance(call, ast.Call):
                name = ast.unparse(call.func)
                for step in SETUP_ONLY:
                    if name == step or name.endswith("." + step):
                        callers.setdefault(step, set()).add(str(path.relative_to(PACKAGE)))
    assert callers == {step: {module} for step, module in SETUP_ONLY.items()}


def definitions(*folders) -> dict:
    """Function name -> the files (relative to the repository) that define it, anywhere in them."""
    found = {}
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    return found


# Helpers written once: where each lives.
HELPERS = {"write_whole": "tpu_keras/workdir.py", "is_remote": "tpu_keras/workdir.py",
           "inside": "tpu_keras/workdir.py", "first_line": "tpu_keras/errors.py",
           "read_run_config": "tpu_keras/config.py", "thawed": "tpu_keras/config.py",
           "set_up": "tpu_keras/training/setup.py", "build_model": "tpu_keras/training/setup.py",
           "with_text_metrics": "tpu_keras/training/setup.py"}


def test_each_helper_is_defined_once():
    defined = definitions("tpu_keras", "scripts", "tests")
    assert {name: defined.get(name) for name in HELPERS} == {
        name: [module] for name, module in HELPERS.items()}


def test_the_tests_folder_holds_test_modules_and_conftest_alone():
    """What `tests/` lists is the tests; the probes the tests start as subprocesses and the
    modules they import live in `tests/helpers/` (conftest.py's docstring says how they are found)."""
    others = sorted(path.name for path in (REPO / "tests").glob("*.py")
                    if path.name != "conftest.py" and not path.name.startswith("test_"))
    assert others == [], f"not a test module: move into tests/helpers/: {others}"


def test_every_test_file_named_in_the_code_and_docs_exists():
    """A path to a file under tests/ (a probe, say) in a test, a helper, a script, the package or
    a document names a file that is there (a test that runs a moved probe would fail late)."""
    texts = [*(REPO / "tests").rglob("*.py"), *(REPO / "scripts").rglob("*.py"), *PACKAGE.rglob("*.py"),
             *(REPO / "docs").rglob("*.md"), REPO / "README.md", REPO / "setup.cfg"]
    named = {(name, str(path.relative_to(REPO))) for path in texts
             for name in re.findall(r"(?<![\w/.])tests/[\w/]+\.py\b", path.read_text())}
    missing = sorted((name, where) for name, where in named if not (REPO / name).is_file())
    assert missing == []


def test_files_are_written_whole_and_paths_told_remote_by_the_workdir_helpers_alone():
    """An atomic write is `workdir.write_whole` (a temporary file, then a rename); a
    path's scheme is `workdir.is_remote`'s business."""
    replaces, scheme_tests = set(), set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "os.replace":
                replaces.add(module)
            if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
                    and node.left.value == "://" and isinstance(node.ops[0], (ast.In, ast.NotIn))):
                scheme_tests.add(module)
    assert replaces == scheme_tests == {"workdir.py"}


# ----- imports at the top of a module -------------------------------------------------

def function_level_imports(source: str) -> list:
    """(line, top-level package) of each import inside a function of `source`."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    found.append((node.lineno, node.module.split(".")[0]))
    return sorted(set(found))


def test_imports_inside_functions_are_few_and_each_module_says_why():
    """A module imports at its top. What start-up (the engine is selected before Keras
    loads), an optional extra or an import cycle keeps inside a function, its module
    says in a comment ("imported inside functions: ..."); the standard library never."""
    stdlib, unexplained = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        source, module = path.read_text(), str(path.relative_to(PACKAGE))
        inside = function_level_imports(source)
        stdlib += [f"{module}:{line} {name}" for line, name in inside if name in sys.stdlib_module_names]
        comments = [token.string.lower() for token in tokenize.generate_tokens(io.StringIO(source).readline)
                    if token.type == tokenize.COMMENT]
        if inside and not any("imported inside" in comment for comment in comments):
            unexplained.append(module)
    assert not stdlib, f"standard-library imports inside functions: {stdlib}"
    assert not unexplained, f"imports inside functions, and no '# ... imported inside ...' comment: {unexplained}"


# One name, one thing. Each of these names one concept, so wherever it is defined in the
# package it takes the same parameters (`distributed_steps`: the public call and each
# engine's own): the step factory and the step, the installers, the command-line start,
# the run and its setup, the checkpointer, the compile counter.
ONE_THING = ("guarded_train_step", "make_guarded_train_step", "distributed_steps", "cache_steps",
             "route_layers", "keep_examples_apart", "install", "start", "run", "train", "set_up",
             "RunSetup", "open_checkpointer", "CompileCounter", "keep_steps")
# Words that once named several things, and the one each names now, as a definition or in
# a module's file name ('grpo_sampling.py' holds 'sampling', 'builders.py' 'builder').
ONE_WORD = {"describe": "a mesh's text (parallelism.mesh)", "Plan": "the user's plan (plan_model)",
            "builder": "a registry Builder from a keras-hub name (models.hub)",
            "defaults": "the config's schema (config.defaults)",
            "sampling": "GRPO's group sampler (models.grpo_sampling)"}
# Names retired because they stood for several things, and what says it now: in the code,
# and in the code and the guides.
RETIRED_IN_CODE = {"saver": "checkpointer", "cache_watch": "compile_counter",
                   "Watch": "CompileCounter"}
RETIRED_WORDS = {"host call": "execution (train.steps_per_execution: Keras's word)",
                 "saver": "checkpointer"}


def top_level_shapes() -> dict:
    """{name: {(module, parameters)}} of every function and class at the top of a module."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                a = node.args
                shape = tuple(x.arg for x in a.posonlyargs + a.args) + tuple(f"*{x.arg}" for x in a.kwonlyargs)
            elif isinstance(node, ast.ClassDef):
                shape = "class"
            else:
                continue
            found.setdefault(node.name, set()).add((module_name(path), shape))
    return found


def test_each_listed_name_is_one_thing():
    defined = top_level_shapes()
    assert defined["distributed_steps"] == {  # the checked name is there, three times
        (module, ("model", "grad_accum_steps")) for module in
        ("tpu_keras.training", "tpu_keras.training.tf_steps", "tpu_keras.training.jax_steps")}
    for name in ONE_THING:
        shapes = {shape for _, shape in defined.get(name, ())}
        assert len(shapes) <= 1, (name, sorted(defined[name]))


def test_each_listed_word_names_one_thing():
    defined = top_level_shapes()
    for word, meaning in ONE_WORD.items():
        things = set(defined.get(word, ()))
        things |= {(module_name(path), "module") for path in PACKAGE.rglob("*.py")
                   if word in path.stem.split("_") or f"{word}s" in path.stem.split("_")}
        assert len(things) == 1, (word, meaning, sorted(things, key=str))


def test_retired_names_are_gone_from_the_package_and_its_guides():
    code = {path: path.read_text() for path in PACKAGE.rglob("*.py")}
    texts = {**code, **{path: path.read_text() for path in [*REPO.glob("docs/*.md"), REPO / "README.md"]}}
    for retired, where in ((RETIRED_IN_CODE, code), (RETIRED_WORDS, texts)):
        for old, new in retired.items():
            pattern = re.compile(rf"\b{re.escape(old)}s?\b")
            found = [str(path.relative_to(REPO)) for path, text in where.items() if pattern.search(text)]
            assert not found, f"{old!r} (now {new}) in {found}"
