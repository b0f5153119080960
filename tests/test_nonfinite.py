"""The NaN guard: one poisoned example makes the loss NaN at a known step."""

import json
import re

import numpy as np
import pytest

from conftest import train
from resume import committed_steps, example_ids, weights

POISONED_ID = 5  # file 0, record 5


@pytest.fixture(scope="module")
def poisoned_config(tmp_path_factory):
    """A config training the digits MLP on TFRecord files, one example of which is NaN."""
    import tensorflow as tf
    folder = tmp_path_factory.mktemp("poisoned")
    rng = np.random.default_rng(0)
    for index in range(2):
        with tf.io.TFRecordWriter(str(folder / f"train-{index}.tfrecord")) as writer:
            for record in range(640):  # 2 x 640 = one epoch of 20 steps of 64
                x = rng.normal(size=4).astype(np.float32)
                if (index, record) == (0, POISONED_ID):
                    x[:] = np.nan
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(x[0] > 0)])),
                })).SerializeToString())
    config = folder / "poisoned.py"
    config.write_text(f"""
import sys
sys.path.insert(0, "configs")
import digits

def get_config(arg=None):
    config = digits.get_config("tiny")
    config.data.update(name="", files="{folder}/train-*.tfrecord", eval_files="{folder}/train-1.tfrecord",
                       features={{"x": "float32[4]", "y": "int64"}}, preprocess="features",
                       inputs="x", targets="y", cache=False, log_example_ids=True)
    config.model.update(image_shape=(4,), num_classes=2)
    config.train.update(steps=20, eval_every=10, steps_per_execution=5)
    return config
""")
    return str(config)


def poisoned_step(workdir):
    """The 1-based step whose batch holds the poisoned example."""
    ids = example_ids(workdir / "example_ids")
    return 1 + min(position for (_, position), batch in ids.items() if POISONED_ID in batch)


def test_stop_names_the_step_and_keeps_the_last_good_checkpoint(poisoned_config, tmp_path):
    result = train(poisoned_config, tmp_path, check=False)
    step = poisoned_step(tmp_path)
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and "Traceback" not in result.stdout
    assert len(errors) == 1 and f"the loss became nan at step {step} " in errors[0], result.stdout[-2000:]
    assert "train.on_nonfinite='restore_and_skip'" in errors[0]
    # Nothing was saved after the divergence, and what was saved is finite.
    saved = committed_steps(tmp_path) if (tmp_path / "checkpoints" / "checkpoint").exists() else []
    assert all(s < step for s in saved), (saved, step)
    for s in saved[-1:]:
        assert all(np.isfinite(v).all() for v in weights(tmp_path, s).values() if v.dtype.kind == "f")


def test_restore_and_skip_leaves_the_batch_out_and_finishes(poisoned_config, tmp_path):
    result = train(poisoned_config, tmp_path, "--config.train.on_nonfinite=restore_and_skip")
    step = poisoned_step(tmp_path)
    assert re.search(rf"the loss became nan at step {step};.*leaving out batch\(es\) \[{step - 1}\]",
                     result.stdout), result.stdout[-3000:]
    assert "done at step 20" in result.stdout
    skipped = json.loads((tmp_path / "checkpoints" / "skipped_batches.json").read_text())
    assert skipped[0] == step - 1
    assert all(np.isfinite(v).all() for v in weights(tmp_path, 20).values() if v.dtype.kind == "f")
