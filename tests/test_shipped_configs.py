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

GRPO's warm start (its :sft command) runs once for the suite, on an empty home of
its own (conftest's `grpo_warm_start`, which tests/test_grpo.py starts from too);
its :tiny command then runs in that home, beside it. Where no :sft run was made
first, the GRPO run stops with one line naming it (a fast check).
"""

import shutil
from pathlib import Path

import pytest

from conftest import assert_one_line_error
from shipped import CONFIGS, chosen_and_before, documented_commands, empty_home_env, in_folder, \
    run_as_documented, variant

NOT_CONFIGS = {"arithmetic_rewards": "grpo_stdlib's reward functions, a module and not a config"}
# Configs whose documented commands cannot run here, and why.
EXCLUDED = {
    "finetune": "its one command fine-tunes a real transformers checkpoint "
                "(gs://bucket/Meta-Llama-3-8B) on text in gs://bucket: a bucket and a "
                "download, neither of which an offline machine has",
}


def test_every_config_file_is_tested_or_excluded_with_a_reason():
    names = {path.stem for path in CONFIGS.glob("*.py")}
    assert set(NOT_CONFIGS) | set(EXCLUDED) <= names
    for name in sorted(names - set(NOT_CONFIGS)):
        assert documented_commands(name), f"configs/{name}.py documents no command"


@pytest.mark.slow
@pytest.mark.parametrize("name", [  # no case skips: the excluded are not cases (above, with why)
    path.stem for path in sorted(CONFIGS.glob("*.py"))
    if path.stem not in NOT_CONFIGS and path.stem not in EXCLUDED])
def test_the_documented_command_runs_on_an_empty_home(name, tmp_path, request):
    home = tmp_path / "home"
    commands = chosen_and_before(name)
    if name == "grpo_stdlib":  # its warm start ran once for the suite, on an empty home of its own
        warm = request.getfixturevalue("grpo_warm_start")
        assert warm["command"] == in_folder(commands[0], Path(warm["folder"])), warm
        assert warm["code"] == 0, f"{warm['command']} exited {warm['code']}:\n{warm['output']}"
        shutil.copytree(warm["folder"], tmp_path, dirs_exist_ok=True)  # its home, and its workdir beside
        commands = commands[1:]
    else:
        home.mkdir()
    env = empty_home_env(home)
    for command in commands:
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
