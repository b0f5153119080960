"""Bad input ends in one line that says what to change, a non-zero exit and no traceback."""

import shutil

import pytest

from conftest import assert_one_line_error, train

LM_TINY = "configs/lm_stdlib.py:tiny"


@pytest.mark.parametrize("override, fragments", [
    ("--config.train.stesp=5", ["--config.train.stesp", "'steps'"]),
    ("--config.trian.steps=5", ["--config.trian.steps", "'train'"]),
    ("--config.model.widht=8", ["model.widht", "'width'"]),
])
def test_mistyped_config_key_names_the_closest_one(tmp_path, override, fragments):
    assert_one_line_error(train(LM_TINY, tmp_path, override, check=False), *fragments)


def test_mistyped_key_inside_a_config_file(tmp_path):
    config = tmp_path / "typo.py"
    config.write_text("import sys; sys.path.insert(0, 'configs')\nimport lm_stdlib\n"
                      "def get_config(arg=None):\n    c = lm_stdlib.get_config('tiny')\n"
                      "    c.train.learnig_rate = 0.1\n    return c\n")
    assert_one_line_error(train(str(config), tmp_path / "w", check=False),
                          "train.learnig_rate", "'learning_rate'")


def test_unknown_precision(tmp_path):
    result = train(LM_TINY, tmp_path, "--config.train.precision=bfloat16", check=False)
    assert_one_line_error(result, "train.precision='bfloat16'", "'mixed_bfloat16'")


def test_batch_that_does_not_divide_across_replicas(tmp_path, data_dir):
    result = train(LM_TINY, tmp_path, "--config.cluster.virtual_devices=4",
                   "--config.train.batch_size=30", f"--config.data.data_dir={data_dir}",
                   check=False)
    assert_one_line_error(result, "batch_size=30", "4 replicas", "multiple of 4")


def test_unknown_dataset(tmp_path, data_dir):
    result = train(LM_TINY, tmp_path, "--config.data.name=stdlib_byte",
                   f"--config.data.data_dir={data_dir}", check=False)
    assert_one_line_error(result, "unknown dataset 'stdlib_byte'", "stdlib_bytes")


def test_tpu_strategy_without_a_tpu(tmp_path):
    result = train(LM_TINY, tmp_path, "--config.cluster.strategy=tpu", check=False)
    assert_one_line_error(result, "no TPU reachable", "cluster.strategy=auto")


def test_missing_config_file(tmp_path):
    assert_one_line_error(train("configs/nope.py", tmp_path, check=False), "configs/nope.py")


def test_resuming_a_different_model_on_the_same_workdir(tmp_path, data_dir, tiny_run):
    shutil.copytree(tiny_run[0] / "checkpoints", tmp_path / "checkpoints")
    result = train(LM_TINY, tmp_path, f"--config.data.data_dir={data_dir}",
                   "--config.model.width=64", check=False)
    assert_one_line_error(result, "does not fit this model", "use a new --workdir")
