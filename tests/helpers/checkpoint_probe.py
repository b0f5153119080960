"""A run's checkpoints pair variables by name, on one engine, in one process.

    python tests/helpers/checkpoint_probe.py ENGINE FOLDER

Saves a small model whose `attention` layer creates two same-shaped weights,
`query` then `key`, with the toolkit's checkpointer, then prints one JSON
line per check:
- SWAPPED: a model whose layer creates them the other way round (`key`, then
  `query`) restores it: each weight's and each optimizer slot's value against
  the saved model's of the same name, and what pairing by position would do;
- WIDER, EXTRA: the errors restoring into a model whose weights are shaped
  otherwise, and one with a weight the checkpoint lacks;
- OLD: a checkpoint written as the toolkit wrote them before they held names
  (by position), restored into the same model;
- ADAPTERS: with `attention` frozen (a LoRA run's base), an adapters-only
  checkpointer's names, and its checkpoint restored into a model whose frozen
  weights are zeroed (they stay so: not in the checkpoint) and into one
  whose base is intact; then a checkpoint of every weight (written before
  checkpoints held adapters alone) restored by an adapters-only checkpointer.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

engine_name, folder = sys.argv[1:3]

from tpu_keras.cluster import engine  # noqa: E402

engine.select(engine_name)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras.training import checkpoint  # noqa: E402

cluster = tpu_keras.connect({})


def report(tag, value):
    print(f"{tag} " + json.dumps(value), flush=True)


class Attention(keras.layers.Layer):
    """x @ query + 2 x @ key, its two weights created in the order `order` names them."""

    def __init__(self, order=("query", "key"), width=4, **kwargs):
        super().__init__(**kwargs)
        self.order, self.width = order, width

    def build(self, input_shape):
        for name in self.order:
            setattr(self, name, self.add_weight(name=name, shape=(input_shape[-1], self.width)))

    def call(self, x):
        return keras.ops.matmul(x, self.query) + 2 * keras.ops.matmul(x, self.key)


def make(order=("query", "key"), width=4, extra=False, frozen=False):
    """The model, compiled with its optimizer built (named: Keras numbers unnamed models);
    `frozen`: its `attention` weights do not train."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((4,)), Attention(order, width, name="attention"),
              keras.layers.Dropout(0.1, name="dropout"), keras.layers.Dense(1, name="head")]
    if extra:
        layers.insert(2, keras.layers.Dense(width, name="extra"))
    with cluster.scope():
        model = keras.Sequential(layers, name="probe")
        for weight in model.get_layer("attention").weights if frozen else ():
            weight.trainable = False
        model.compile(keras.optimizers.Adam(0.1), "mse")
        model.optimizer.build(model.trainable_variables)
    return model


def values(model):
    """{path: value} of the model's weights and of the optimizer's variables."""
    return {v.path.replace(f"{model.optimizer.name}/", "optimizer/", 1): keras.ops.convert_to_numpy(v)
            for v in model.weights + model.optimizer.variables}


def restore_error(model, workdir):
    try:
        checkpoint.open_checkpointer(workdir, model, cluster).restore_latest()
    except tpu_keras.UserError as error:
        return str(error)
    return None


rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
saved = make()
for _ in range(4):  # 4 updates (from random gradients: cheaper than a compiled step)
    saved.optimizer.apply([rng.normal(size=v.shape).astype("float32") for v in saved.trainable_variables])
checkpointer = checkpoint.open_checkpointer(os.path.join(folder, "run"), saved, cluster)
checkpointer.save()

# ----- the other creation order --------------------------------------------------------
swapped = make(order=("key", "query"))
step = checkpoint.open_checkpointer(os.path.join(folder, "run"), swapped, cluster).restore_latest()
ours, theirs = values(saved), values(swapped)
report("SWAPPED", {
    "step": step,
    "saved_order": [w.path for w in saved.weights], "loaded_order": [w.path for w in swapped.weights],
    "names": sorted(ours) == sorted(theirs),
    "apart": max(float(np.max(np.abs(ours[k] - theirs[k]))) for k in ours),
    # Pairing by position would have put the saved query into the key, and back.
    "by_position_apart": max(float(np.max(np.abs(a - b.value))) for a, b in
                             zip(saved.get_weights(), swapped.weights)),
    "predictions_apart": float(np.max(np.abs(saved.predict(x, verbose=0) - swapped.predict(x, verbose=0)))),
})

# ----- models the checkpoint does not fit ---------------------------------------------
report("WIDER", restore_error(make(width=8), os.path.join(folder, "run")))
report("EXTRA", restore_error(make(extra=True), os.path.join(folder, "run")))

# ----- a checkpoint stored by position, as before names ---------------------------------
old_dir = os.path.join(folder, "old", "checkpoints")
if engine_name == "tf":
    import tensorflow as tf
    old = tf.train.Checkpoint(model=saved, optimizer=saved.optimizer,
                              rng=list(saved.non_trainable_variables))
    old.save_counter
    old.write(os.path.join(old_dir, f"ckpt-{checkpointer.step}"))
    with open(os.path.join(old_dir, "checkpoint"), "w") as state:
        state.write(f'model_checkpoint_path: "ckpt-{checkpointer.step}"\n'
                    f'all_model_checkpoint_paths: "ckpt-{checkpointer.step}"\n')
else:
    import orbax.checkpoint as ocp
    manager = ocp.CheckpointManager(os.path.abspath(old_dir), options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False))
    manager.save(checkpointer.step, args=ocp.args.StandardSave(
        {"model": [v.value for v in saved.variables],
         "optimizer": [v.value for v in saved.optimizer.variables]}), force=True)
    manager.wait_until_finished()
loaded = make()
step = checkpoint.open_checkpointer(os.path.join(folder, "old"), loaded, cluster).restore_latest()
ours, theirs = values(saved), values(loaded)
report("OLD", {"step": step, "apart": max(float(np.max(np.abs(ours[k] - theirs[k]))) for k in ours)})

# ----- a LoRA run's checkpoints: what trains alone -----------------------------------------
def zeroed_base(model):
    for weight in model.get_layer("attention").weights:
        weight.assign(np.zeros(weight.shape, "float32"))
    return model


def apart(a, b):
    ours, theirs = values(a), values(b)
    return max(float(np.max(np.abs(ours[k] - theirs[k]))) for k in ours)


adapted = make(frozen=True)
for _ in range(4):
    adapted.optimizer.apply([rng.normal(size=v.shape).astype("float32")
                             for v in adapted.trainable_variables])
checkpoint.open_checkpointer(os.path.join(folder, "adapters"), adapted, cluster,
                             adapters_only=True).save()
held = checkpoint.keyed_variables(adapted, adapters_only=True)
zeroed = zeroed_base(make(frozen=True))
intact = make(frozen=True)
for model in (zeroed, intact):
    checkpoint.open_checkpointer(os.path.join(folder, "adapters"), model, cluster,
                                 adapters_only=True).restore_latest()
checkpoint.open_checkpointer(os.path.join(folder, "everything"), adapted, cluster).save()
whole = make(frozen=True)
step = checkpoint.open_checkpointer(os.path.join(folder, "everything"), whole, cluster,
                                    adapters_only=True).restore_latest()
report("ADAPTERS", {
    "model": sorted(held[checkpoint.MODEL]), "optimizer": len(held[checkpoint.OPTIMIZER]),
    "zeroed_base": float(np.abs(keras.ops.convert_to_numpy(zeroed.get_layer("attention").query)).max()),
    "head_apart": float(np.abs(keras.ops.convert_to_numpy(zeroed.get_layer("head").kernel)
                               - keras.ops.convert_to_numpy(adapted.get_layer("head").kernel)).max()),
    "intact_apart": apart(adapted, intact), "whole_step": step, "whole_apart": apart(adapted, whole)})
