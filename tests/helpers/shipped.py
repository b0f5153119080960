"""The shipped configs' documented commands, run as their docstrings show them: on an empty
home, each in a process of its own (tests/test_shipped_configs.py; conftest's
`grpo_warm_start` runs GRPO's documented warm start once for the suite)."""

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import REPO

CONFIGS = REPO / "configs"
COMMAND = re.compile(r"^\s*(python -m tpu_keras\.\w+ .*)$", re.M)
SECONDS_PER_COMMAND = 900  # each takes under a minute alone on the 2-core machine


def documented_commands(name: str) -> list[str]:
    """The `python -m tpu_keras.*` command lines of configs/NAME.py's docstring, in order."""
    docstring = ast.get_docstring(ast.parse((CONFIGS / f"{name}.py").read_text())) or ""
    return COMMAND.findall(re.sub(r"\\\n\s*", " ", docstring))


def flag(command: str, name: str) -> str:
    values = [arg.split("=", 1)[1] for arg in shlex.split(command) if arg.startswith(f"--{name}=")]
    assert len(values) == 1, (command, name)
    return values[0]


def variant(command: str) -> str:
    return flag(command, "config").partition(":")[2]


def same_run(documented: str, named: str) -> bool:
    """Whether a docstring's command (its paths from the repository) and one a config names
    (its paths from this process's folder, where the config was loaded) run the same: the
    same tool, config file and variant, and a workdir of the same name."""
    def key(command, folder):
        path, _, chosen = flag(command, "config").partition(":")
        return (shlex.split(command)[2], os.path.realpath(os.path.join(folder, path)), chosen,
                os.path.basename(os.path.normpath(flag(command, "workdir"))))
    return key(documented, REPO) == key(named, os.getcwd())


def in_folder(command: str, folder: Path) -> str:
    """`command` with its --workdir moved into `folder`, keeping its name (/tmp/grpo_tiny ->
    FOLDER/grpo_tiny), so runs the docstring puts side by side stay side by side."""
    workdir = flag(command, "workdir")
    return command.replace(f"--workdir={workdir}",
                           f"--workdir={folder / os.path.basename(os.path.normpath(workdir))}")


def chosen_and_before(name: str) -> list[str]:
    """The config's :tiny command (or its first), after the documented commands it needs."""
    from tpu_keras import cli
    commands = documented_commands(name)
    assert commands, f"configs/{name}.py's docstring shows no `python -m tpu_keras.*` command"
    chosen = next((c for c in commands if variant(c) == "tiny"), commands[0])
    needed = []
    path, colon, chosen_variant = flag(chosen, "config").partition(":")
    config = cli.load_config(f"{REPO / path}{colon}{chosen_variant}")
    written_by = config.model.get("preset_written_by", "")
    if written_by:
        from tpu_keras.models import hub
        first = hub.expand_command(written_by, os.path.normpath(flag(chosen, "workdir")))
        before = commands[:commands.index(chosen)]
        documented = [c for c in before if same_run(c, first)]
        assert documented, (f"configs/{name}.py: model.preset_written_by's `{first}` is not "
                            f"among the commands its docstring shows before `{chosen}`")
        needed.append(documented[0])
    return needed + [chosen]


def empty_home_env(home: Path) -> dict:
    """This process's environment with HOME `home` and nothing pointing past it: the data
    dir, the toolkit's cache (the suite's own, see conftest) and Keras's folder are HOME's."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("TF_CONFIG", "TPU_KERAS_CACHE_DIR", "KERAS_HOME", "TFDS_DATA_DIR",
                          "XDG_CACHE_HOME")}
    env.update(HOME=str(home), TPU_SKIP_MDS_QUERY="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONUNBUFFERED="1")
    return env


def run_as_documented(command: str, env: dict) -> subprocess.CompletedProcess:
    args = [sys.executable, *shlex.split(command)[1:]]  # this interpreter for `python`
    return subprocess.run(args, cwd=REPO, env=env, timeout=SECONDS_PER_COMMAND, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
