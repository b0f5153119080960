"""The NaN guard: one poisoned example makes the loss or the gradients non-finite at a known step.

Whether a NaN input reaches the loss depends on the CPU's kernels (a fused
`relu(matmul(x, w) + b)` can turn it into zeros), but it always reaches the
gradient of `w`: the guard watches both, so these tests hold on any CPU. The
last case is finite by construction in the forward pass and NaN in the
backward pass on every machine: an L2-norm feature of a zero vector.
"""

import json
import re

import numpy as np
import pytest

from conftest import train
from resume import committed_steps, example_ids, weights

POISONED_ID = 5  # file 0, record 5

CONFIG = """
import sys
sys.path.insert(0, "configs")
sys.path.insert(0, "tests/helpers")
import digits

def get_config(arg=None):
    config = digits.get_config("tiny")
    config.data.tfds.update(name="", eval_split="validation")
    config.data.tfrecords.update(files="{folder}/train-*.tfrecord", eval_files="{folder}/train-1.tfrecord",
                                 features={{"x": "float32[4]", "y": "int64"}})
    config.data.update(preprocess="features", inputs="x", targets="y", cache=False,
                       log_example_ids=True)
    config.model.update(image_shape=(4,), num_classes=2)
    config.train.update(steps=20, eval_every=10, steps_per_execution=5)
    if arg == "norm":  # a model whose loss stays finite at the poisoned example
        import norm_model
        config.model = dict(name="norm_features", input_dim=4, num_classes=2)
    return config
"""


def write_poisoned(folder, poison):
    """Two TFRecord files of 640 examples (one epoch: 20 steps of 64); example 5 of file 0
    has every feature set to `poison`."""
    import tensorflow as tf
    rng = np.random.default_rng(0)
    folder.mkdir()
    for index in range(2):
        with tf.io.TFRecordWriter(str(folder / f"train-{index}.tfrecord")) as writer:
            for record in range(640):
                x = rng.normal(size=4).astype(np.float32)
                if (index, record) == (0, POISONED_ID):
                    x[:] = poison
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(x[0] > 0)])),
                })).SerializeToString())
    config = folder / "poisoned.py"
    config.write_text(CONFIG.format(folder=folder))
    return str(config)


@pytest.fixture(scope="module")
def nan_config(tmp_path_factory):
    """The digits MLP on examples of which one is all NaN."""
    return write_poisoned(tmp_path_factory.mktemp("poisoned") / "nan", np.nan)


@pytest.fixture(scope="module")
def zero_config(tmp_path_factory):
    """An L2-norm-feature model on examples of which one is all zeros (use with ':norm')."""
    return write_poisoned(tmp_path_factory.mktemp("poisoned") / "zero", 0.0) + ":norm"


def poisoned_step(workdir):
    """The 1-based step whose batch holds the poisoned example."""
    ids = example_ids(workdir / "example_ids")
    return 1 + min(position for (_, position), batch in ids.items() if POISONED_ID in batch)


def error_line(result):
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and "Traceback" not in result.stdout
    assert len(errors) == 1, result.stdout[-2000:]
    return errors[0]


def assert_saved_before(workdir, step):
    """Nothing was saved at or after `step`, and the newest checkpoint is finite."""
    saved = committed_steps(workdir) if (workdir / "checkpoints" / "checkpoint").exists() else []
    assert all(s < step for s in saved), (saved, step)
    for s in saved[-1:]:
        assert all(np.isfinite(v).all() for v in weights(workdir, s).values() if v.dtype.kind == "f")


@pytest.mark.slow
def test_stop_names_the_step_and_keeps_the_last_good_checkpoint(nan_config, tmp_path):
    result = train(nan_config, tmp_path, check=False)
    step = poisoned_step(tmp_path)
    error = error_line(result)
    # The loss or the gradient norm, depending on how this CPU's kernels treat NaN.
    assert re.search(rf"the (loss|gradient norm) became nan at step {step} ", error), error
    assert "train.on_nonfinite='restore_and_skip'" in error
    assert_saved_before(tmp_path, step)


@pytest.mark.slow
def test_restore_and_skip_leaves_the_batch_out_and_finishes(nan_config, tmp_path):
    result = train(nan_config, tmp_path, "--config.train.on_nonfinite=restore_and_skip")
    step = poisoned_step(tmp_path)
    assert re.search(rf"became nan at step {step};.*leaving out batch\(es\) \[{step - 1}\]",
                     result.stdout), result.stdout[-3000:]
    assert "done at step 20" in result.stdout
    assert re.search(r"weights fingerprint: -?\d", result.stdout), result.stdout[-1000:]
    skipped = json.loads((tmp_path / "checkpoints" / "skipped_batches.json").read_text())
    assert skipped[0] == step - 1
    assert all(np.isfinite(v).all() for v in weights(tmp_path, 20).values() if v.dtype.kind == "f")


def test_a_finite_loss_with_a_nan_gradient_stops_at_that_step(zero_config, tmp_path):
    result = train(zero_config, tmp_path, check=False)
    step = poisoned_step(tmp_path)
    error = error_line(result)
    # The loss is checked first: naming the gradient norm means the loss was finite.
    assert f"the gradient norm became nan at step {step} " in error, error
    assert_saved_before(tmp_path, step)


@pytest.mark.slow
def test_the_jax_engine_skips_the_update_of_a_nan_gradient_too(zero_config, tmp_path):
    result = train(zero_config, tmp_path, "--config.engine=jax", check=False,
                   env={"KERAS_BACKEND": "jax"})
    step = poisoned_step(tmp_path)
    error = error_line(result)
    # Keras's jax loop runs an execution's 5 steps at once: the error names the call's steps.
    first, last = map(int, re.search(r"the gradient norm became \S+ at one of steps (\d+)-(\d+) ",
                                     error).groups())
    assert first <= step <= last and last - first < 5, error
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and saved[-1] < step, saved
