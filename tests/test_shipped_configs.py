"""Every shipped config's documented command runs on an empty home.

Each config file's docstring shows its commands (`python -m tpu_keras.train
--config=configs/NAME.py:VARIANT --workdir=...`). For each config this runs
its `:tiny` command (or, where none is documented, its first), after the
commands it needs first, in the docstring's order, each in a process of its
own with HOME an empty folder: the data dir (`~/tensorflow_datasets`), the
toolkit's cache and Keras's folder all start empty, as on a new machine. A
command needs another first where its config says which command writes its
`model.preset` (`model.preset_written_by`: GRPO's warm start); that command
must be one of the docstring's, above the one that needs it.

Where no :sft run was made first, the GRPO run stops with one line naming it
(a fast check).
"""

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_one_line_error

CONFIGS = REPO / "configs"
NOT_CONFIGS = {"arithmetic_rewards": "grpo_stdlib's reward functions, a module and not a config"}
# Configs whose documented commands cannot run here, and why.
EXCLUDED = {
    "finetune": "its one command fine-tunes a real transformers checkpoint "
                "(gs://bucket/Meta-Llama-3-8B) on text in gs://bucket: a bucket and a "
                "download, neither of which an offline machine has",
}
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


def test_every_config_file_is_tested_or_excluded_with_a_reason():
    names = {path.stem for path in CONFIGS.glob("*.py")}
    assert set(NOT_CONFIGS) | set(EXCLUDED) <= names
    for name in sorted(names - set(NOT_CONFIGS)):
        assert documented_commands(name), f"configs/{name}.py documents no command"


@pytest.mark.slow
@pytest.mark.parametrize("name", [  # no case skips: the excluded are not cases (above, with why)
    path.stem for path in sorted(CONFIGS.glob("*.py"))
    if path.stem not in NOT_CONFIGS and path.stem not in EXCLUDED])
def test_the_documented_command_runs_on_an_empty_home(name, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = empty_home_env(home)
    for command in chosen_and_before(name):
        command = in_folder(command, tmp_path)
        result = run_as_documented(command, env)
        assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout[-4000:]}"
    # The data came from nowhere but the run itself, into the empty home's data dir.
    assert (home / "tensorflow_datasets").is_dir(), sorted(p.name for p in home.iterdir())


def test_grpo_without_its_warm_start_names_the_command_that_writes_it(tmp_path):
    # configs/grpo_stdlib.py:tiny on an empty home, with no :sft run beside its workdir: one
    # line that names the docstring's first command, with the folder beside this run's.
    sft, tiny = (in_folder(c, tmp_path) for c in chosen_and_before("grpo_stdlib"))
    assert variant(sft) == "sft" and variant(tiny) == "tiny", (sft, tiny)
    home = tmp_path / "home"
    home.mkdir()
    result = run_as_documented(tiny, empty_home_env(home))
    assert result.returncode == 2, result.stdout[-3000:]
    assert_one_line_error(result, "arithmetic_sft/export/keras_hub' does not exist yet",
                          f"run `{sft}` first")
    assert sft == ("python -m tpu_keras.train --config=configs/grpo_stdlib.py:sft "
                   f"--workdir={tmp_path / 'arithmetic_sft'}")
