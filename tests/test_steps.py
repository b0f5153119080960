"""`distributed_steps` makes a user's own model fit, evaluate and predict with
steps_per_execution > 1 under one device, Mirrored and MultiWorkerMirrored; `connect`
keeps TensorFlow's CPU memory between steps unless the user said otherwise; a float16
model's loss scaling runs in the toolkit's own step on the tf engine."""

import json
import math
import re
import sys

import pytest

from conftest import run_command

USER_SCRIPT = """
import os, numpy as np, tensorflow as tf, keras, tpu_keras
cluster = tpu_keras.connect({})
strategy, GB = cluster.strategy, 64
X = np.random.RandomState(0).rand(GB * 20 + 40, 8).astype("float32"); Y = X.sum(1, keepdims=True)
def dataset(training):
    def fn(ctx):
        ds = tf.data.Dataset.from_tensor_slices((X, Y)).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        ds = ds.batch(ctx.get_per_replica_batch_size(GB), drop_remainder=training)
        return ds.repeat() if training else ds
    return strategy.distribute_datasets_from_function(fn)
print("REPLICAS", strategy.num_replicas_in_sync)
from tpu_keras.cluster import engine
print("KEEPS_CPU_MEMORY", engine.keeps_cpu_memory())
os.environ.pop(engine.CPU_ALLOCATOR_ENV)  # unset, as if nothing asked before TensorFlow started:
engine.select("tf")                       # the toolkit sets it now, too late to take effect
print("KEEPS_WHEN_SET_LATE", os.environ[engine.CPU_ALLOCATOR_ENV], engine.keeps_cpu_memory())
for jit in map(int, os.environ["JIT"].split(",")):  # one start of TensorFlow for both
    tag = "_XLA" if jit else ""
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"], steps_per_execution=4,
                      jit_compile=bool(jit))
    tpu_keras.distributed_steps(model)
    history = model.fit(dataset(True), epochs=3, steps_per_epoch=8, validation_data=dataset(False), verbose=0)
    print("STEPS" + tag, int(model.optimizer.iterations.numpy()))
    print("LOSS" + tag, [round(x, 4) for x in history.history["loss"]])
    print("EVAL" + tag, model.evaluate(dataset(False), verbose=0, return_dict=True)["loss"])
    print("PREDICT" + tag, model.predict(X[:130], batch_size=GB, verbose=0).shape)
    print("WEIGHTS" + tag, repr(sum(float(w.sum()) for w in model.get_weights())))
"""


def fit_under(launch_args, jit="0", env=None):
    """The script's output on the launched hosts, for each of `jit`'s modes ('0', '1' or '0,1')."""
    result = run_command([sys.executable, "-m", "tpu_keras.launch", *launch_args, "--timeout=240",
                  "--", sys.executable, "-c", USER_SCRIPT], timeout=300, env={"JIT": jit, **(env or {})})
    return result.stdout


def values(output, key):
    return re.findall(rf"\] {key} (.+)", output)


@pytest.mark.parametrize("launch_args, replicas, jit, allocator", [
    pytest.param(["--hosts=1", "--devices_per_host=1"], 1, "0", "false",  # the user's choice stands
                 marks=pytest.mark.slow),  # over 10 s: the full suite's (the fast tier keeps within 5 minutes)
    pytest.param(["--hosts=2", "--devices_per_host=2"], 4, "1", None,  # XLA: the toolkit's per-replica
                 marks=pytest.mark.slow),                               # step across hosts
])
def test_user_model_fits_with_steps_per_execution(launch_args, replicas, jit, allocator):
    output = fit_under(launch_args, jit, {"TF_CPU_ALLOCATOR_USE_BFC": allocator} if allocator else {})
    hosts = int(launch_args[0].split("=")[1])
    assert values(output, "REPLICAS") == [str(replicas)] * hosts
    assert values(output, "KEEPS_CPU_MEMORY") == [str(allocator is None)] * hosts
    # Known from what was asked for and when, not from TensorFlow's memory statistics (which
    # answer under either allocator on some machines).
    assert values(output, "KEEPS_WHEN_SET_LATE") == ["true False"] * hosts
    for tag in ["_XLA" if mode == "1" else "" for mode in jit.split(",")]:
        assert values(output, "STEPS" + tag) == ["24"] * hosts          # 3 epochs x 8 steps, none lost
        losses = [eval(v) for v in values(output, "LOSS" + tag)]
        assert losses[0][-1] < losses[0][0] / 2                         # it learns
        assert values(output, "PREDICT" + tag) == ["(130, 1)"] * hosts  # every example, in order
        assert len(set(values(output, "WEIGHTS" + tag))) == 1           # hosts agree
        assert len(set(values(output, "EVAL" + tag))) == 1


@pytest.mark.slow
def test_xla_per_replica_step_matches_the_unjitted_step_under_mirrored():
    """Keras's own jit_compile fails under Mirrored (keras-team/keras#19005); the
    toolkit compiles each replica's step instead, and trains the same model."""
    output = fit_under(["--hosts=1", "--devices_per_host=4"], "0,1")
    assert values(output, "REPLICAS") == ["4"]
    assert values(output, "STEPS_XLA") == ["24"]
    plain_losses, xla_losses = eval(values(output, "LOSS")[0]), eval(values(output, "LOSS_XLA")[0])
    assert xla_losses[-1] < xla_losses[0] / 2
    assert xla_losses == pytest.approx(plain_losses, rel=1e-3)
    assert float(values(output, "WEIGHTS_XLA")[0]) == pytest.approx(float(values(output, "WEIGHTS")[0]), rel=1e-4)


LOSS_SCALE_SCRIPT = """
import json, numpy as np, tensorflow as tf, keras, tpu_keras
mirrored = tpu_keras.connect({"virtual_devices": 2}).strategy  # Mirrored over 2 CPU devices
class Steps(keras.callbacks.Callback):  # the loss scale and grad_norm after each execution
    def __init__(self):
        super().__init__()
        self.scales, self.norms = [], []
    def on_train_batch_end(self, batch, logs=None):
        self.scales.append(float(self.model.optimizer.dynamic_scale.numpy()))
        self.norms.append(str(float(logs.get("grad_norm", "nan"))))
rng = np.random.default_rng(0)
x = rng.normal(size=(20 * 16, 8)).astype("float32")
y = x.sum(axis=1, keepdims=True)
weights = {}
for name, toolkit, strategy, jit, accum, per_call, growth in [  # 20 steps of 16 rows each
        ("keras", False, None, False, 1, 1, 4), ("toolkit", True, None, True, 1, 1, 4),
        ("mirrored", True, mirrored, True, 1, 1, 4), ("accumulated", True, mirrored, False, 2, 4, 1000)]:
    with (strategy or tf.distribute.get_strategy()).scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(16, activation="relu", dtype="mixed_float16"),
                                  keras.layers.Dense(1, dtype="mixed_float16")])
        # 2**24 times the loss overflows float16's 65504 in the backward pass.
        model.compile(keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.01), initial_scale=2.0**24, dynamic_growth_steps=growth), "mse",
            jit_compile=jit, steps_per_execution=per_call)
    if toolkit:
        tpu_keras.distributed_steps(model, grad_accum_steps=accum)
    steps = Steps()
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), verbose=0, callbacks=[steps])
    weights[name] = model.get_weights()
    print("SCALE " + json.dumps({"name": name, "scales": steps.scales, "norms": steps.norms,
                                 "updates": int(model.optimizer.iterations.numpy()),
                                 "loss": history.history["loss"][0],
                                 "finite": all(bool(np.isfinite(w).all()) for w in weights[name]),
                                 "apart": max(float(np.max(np.abs(a - b)))
                                              for a, b in zip(weights[name], weights["keras"]))}))
"""


def keras_loss_scale_rule(norms, growth_steps, scale=2.0**24):
    """The scale after each step by Keras's LossScaleOptimizer's rule, from each step's
    gradient norm: halved when it is not finite; doubled after `growth_steps` finite ones."""
    scales, finite_run = [], 0
    for norm in norms:
        if math.isfinite(norm):
            finite_run += 1
            if finite_run == growth_steps:
                scale, finite_run = scale * 2, 0
        else:
            scale, finite_run = scale / 2, 0
        scales.append(scale)
    return scales


@pytest.mark.slow
def test_loss_scaling_runs_in_the_toolkits_step_on_tf_with_its_guard_and_accumulation():
    """float16 on the tf engine: the toolkit's own step scales the loss, logs the unscaled
    gradient norm, and leaves an overflow to the LossScaleOptimizer (its scale halved, no
    update), on one device (as plain Keras), under Mirrored and with micro-batches."""
    out = run_command([sys.executable, "-c", LOSS_SCALE_SCRIPT], timeout=300,
                      env={"KERAS_BACKEND": "tensorflow"}).stdout
    runs = {r["name"]: r for r in (json.loads(line[len("SCALE "):]) for line in out.splitlines()
                                   if line.startswith("SCALE "))}
    assert set(runs) == {"keras", "toolkit", "mirrored", "accumulated"}, out[-3000:]
    keras_run = runs["keras"]
    assert keras_run["scales"][-1] < 2.0**24 and 0 < keras_run["updates"] < 20, keras_run  # some overflowed
    # One device, the whole step compiled by XLA: the scale after every step, the updates and
    # the weights are plain Keras's.
    toolkit = runs["toolkit"]
    assert toolkit["scales"] == keras_run["scales"] and toolkit["updates"] == keras_run["updates"], toolkit
    assert toolkit["apart"] <= 1e-3, toolkit
    # The norm logged is the unscaled gradients': non-finite where the step overflowed.
    for run in (toolkit, runs["mirrored"]):
        norms = [float(n) for n in run["norms"]]
        assert run["scales"] == keras_loss_scale_rule(norms, 4), run
        assert run["updates"] == sum(map(math.isfinite, norms)) and run["finite"], run
        assert all(n < 100 for n in norms if math.isfinite(n)), run  # not 2**k times larger
    # Under Mirrored each replica's float16 backward pass sums its own 8 rows, so its overflows
    # are its own; the gradients are summed before the check, so no replica's overflow is applied.
    assert math.isfinite(runs["mirrored"]["loss"]), runs["mirrored"]
    # 2 micro-batches a replica, 4 steps an execution (the scale only falls: growth after 1000
    # steps): every step ran, each an update or a halving, though some executions held overflows.
    accumulated = runs["accumulated"]
    halvings = round(math.log2(2.0**24 / accumulated["scales"][-1]))
    assert len(accumulated["scales"]) == 5 and 0 < accumulated["updates"] < 20, accumulated
    assert accumulated["updates"] + halvings == 20 and accumulated["finite"], accumulated
