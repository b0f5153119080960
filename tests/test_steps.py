"""`distributed_steps` makes a user's own model fit, evaluate and predict with
steps_per_execution > 1 under one device, Mirrored and MultiWorkerMirrored."""

import re
import sys

import pytest

from conftest import run

USER_SCRIPT = """
import numpy as np, tensorflow as tf, keras, tpu_keras
cluster = tpu_keras.connect({})
strategy, GB = cluster.strategy, 64
X = np.random.RandomState(0).rand(GB * 20 + 40, 8).astype("float32"); Y = X.sum(1, keepdims=True)
def dataset(training):
    def fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((X, Y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        ds = ds.batch(ctx.get_per_replica_batch_size(GB), drop_remainder=training)
        return ds.repeat() if training else ds
    return strategy.distribute_datasets_from_function(fn)
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"], steps_per_execution=4)
tpu_keras.distributed_steps(model)
history = model.fit(dataset(True), epochs=3, steps_per_epoch=8, validation_data=dataset(False), verbose=0)
print("REPLICAS", strategy.num_replicas_in_sync)
print("STEPS", int(model.optimizer.iterations.numpy()))
print("LOSS", [round(x, 4) for x in history.history["loss"]])
print("EVAL", model.evaluate(dataset(False), verbose=0, return_dict=True)["loss"])
print("PREDICT", model.predict(X[:130], batch_size=GB, verbose=0).shape)
print("WEIGHTS", repr(sum(float(w.sum()) for w in model.get_weights())))
"""


def fit_under(launch_args):
    result = run([sys.executable, "-m", "tpu_keras.launch", *launch_args, "--timeout=240",
                  "--", sys.executable, "-c", USER_SCRIPT], timeout=300)
    return result.stdout


def values(output, key):
    return re.findall(rf"\] {key} (.+)", output)


@pytest.mark.parametrize("launch_args, replicas", [
    (["--hosts=1", "--devices_per_host=1"], 1),
    (["--hosts=1", "--devices_per_host=4"], 4),
    (["--hosts=2", "--devices_per_host=2"], 4),
])
def test_user_model_fits_with_steps_per_execution(launch_args, replicas):
    output = fit_under(launch_args)
    hosts = int(launch_args[0].split("=")[1])
    assert values(output, "REPLICAS") == [str(replicas)] * hosts
    assert values(output, "STEPS") == ["24"] * hosts          # 3 epochs x 8 steps, none lost
    losses = [eval(v) for v in values(output, "LOSS")]
    assert losses[0][-1] < losses[0][0] / 2                   # it learns
    assert values(output, "PREDICT") == ["(130, 1)"] * hosts  # every example, in order
    assert len(set(values(output, "WEIGHTS"))) == 1           # hosts agree
    assert len(set(values(output, "EVAL"))) == 1
