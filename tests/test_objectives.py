"""Objectives as registered things: chosen by `train.objective` (or the data's kind), each
owning its section; a user's own, from a file, trains like the toolkit's."""

import json
import re

import pytest

from conftest import assert_one_line_error, train
from tpu_keras import config as config_lib, objectives
from tpu_keras.errors import UserError

DIGITS_TINY = "configs/digits.py:tiny"


def with_data(**parts):
    config = config_lib.defaults()
    config.data.tfds.name = ""
    for part, files in parts.items():
        config.data[part].files = files
    return config


def test_auto_takes_the_objective_made_for_the_datas_kind_and_a_mismatch_is_one_line():
    assert {"sft", "dpo", "grpo"} <= set(objectives.REGISTRY)
    assert objectives.of(config_lib.defaults()).name == "sft"  # TFDS data
    assert objectives.of(with_data(text="t/*.txt")).name == "sft"
    assert objectives.of(with_data(preferences="p/*.jsonl")).name == "dpo"
    assert objectives.of(with_data(prompts="q/*.jsonl")).name == "grpo"
    config = with_data(text="t/*.txt")
    config.train.objective = "dpo"
    with pytest.raises(UserError, match=r"^train.objective='dpo' reads data.preferences, and this "
                                        r"config reads data.text"):
        objectives.of(config)
    config.train.objective = "dop"
    with pytest.raises(UserError, match=r"^train.objective='dop' is not a registered objective.*"
                                        r"did you mean 'dpo'"):
        objectives.check(config)


def test_a_section_of_another_objective_is_refused_and_dpo_beta_moved(tmp_path):
    config = with_data(text="t/*.txt")
    config.dpo.beta = 0.5
    with pytest.raises(UserError, match=r"^dpo.beta is set, but this run reads data.text, so dpo "
                                        r"would be ignored; drop it, or set data.preferences.files"):
        objectives.check(config)
    config = with_data(preferences="p/*.jsonl")
    config.train.dpo_beta = 0.5  # a config file of before
    with pytest.raises(UserError, match=r"^train.dpo_beta moved to dpo.beta"):
        objectives.check(config)
    (tmp_path / "config.json").write_text(json.dumps({"train": {"dpo_beta": 0.25}}))
    read = config_lib.read_run_config(str(tmp_path))  # a workdir of before still reads
    assert read.dpo.beta == 0.25 and "dpo_beta" not in read.train


DOUBLED = '''
import dataclasses

import keras

from tpu_keras import objectives


class Doubled(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return 2.0 * keras.losses.sparse_categorical_crossentropy(y_true, y_pred)


class DoubledCrossEntropy(objectives.Objective):
    """Twice the cross-entropy, with the cross-entropy itself as a metric beside it."""
    name, data_kinds = "doubled", ("tfds",)

    def builder(self, builder, config):
        own = builder.metrics
        return dataclasses.replace(builder, loss=Doubled, metrics=lambda: own() + [
            keras.metrics.SparseCategoricalCrossentropy(name="cross_entropy")])


objectives.register(DoubledCrossEntropy())
'''


@pytest.mark.slow
def test_an_objective_of_the_users_own_trains_from_a_file(tmp_path, data_dir):
    (tmp_path / "doubled.py").write_text(DOUBLED)
    out = train(DIGITS_TINY, tmp_path / "run", f"--config.data.data_dir={data_dir}",
                f"--config.model.imports=('{tmp_path / 'doubled.py'}',)",
                "--config.train.objective=doubled").stdout
    assert re.search(r"model: .*, objective doubled\n", out), out[-3000:]
    last = re.findall(r"step 20/20 \|.*", out)[-1]
    # The interval's means over the same batches (validation pads its last batch, which
    # Keras's loss and a metric weigh apart).
    loss, cross_entropy = (float(re.search(rf"\| {name} (\S+)", last).group(1))
                           for name in ("loss", "cross_entropy"))
    assert loss == pytest.approx(2 * cross_entropy, rel=2e-3), last

    typo = train(DIGITS_TINY, tmp_path / "typo", f"--config.data.data_dir={data_dir}",
                 f"--config.model.imports=('{tmp_path / 'doubled.py'}',)",
                 "--config.train.objective=dubled", check=False)
    assert_one_line_error(typo, "train.objective='dubled' is not a registered objective",
                          "did you mean 'doubled'")
