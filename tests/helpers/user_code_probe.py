"""docs/parallelism.md's `<!-- user-code-mesh -->` example as written, then what it promises, in one process.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/helpers/user_code_probe.py

Runs the example (a transformer of Keras layers on fsdp=2 x model=2), then
in the same process, on its cluster and its functions, prints one JSON line
per check:
- SINGLE: the example's losses, and the same model's on one device (no
  distribution: every weight on the first device) from the same seed and data;
- REMOVED: a rule removed: the error, the shapes of the kernels initialized
  (allocated) before it, and whether the distribution in force is back;
- SECOND: a second model with other rules (a keras LayoutMap) in the same
  process: how its weights and the first model's are laid out;
- ACCUM: one update from 4 micro-batches of 16 against one from the 64 together;
- PLAN: `plan_model` against the CLI's plan of the model registered as a builder;
- MEASURE: `plan_model(..., measure=True)` on a 4-device slice, by the TPU compiler
  (the default, with libtpu installed) and by XLA:CPU on this process's devices;
- SCALE: a float16 model with a loss scale so large that its gradients overflow,
  20 steps under plain Keras (one device) and under `distributed_steps` (data
  parallel over the mesh): the loss scale after each step, the updates made
  and how far the weights ended apart.
"""

import contextlib
import json
import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "parallelism.md"
code = re.search(r"<!-- user-code-mesh -->\n```python\n(.*?)```", GUIDE.read_text(), re.S).group(1)
ns = {"__name__": "__main__"}
exec(compile(code, "docs/parallelism.md", "exec"), ns)  # noqa: S102  (the example, as written)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras import data  # noqa: E402

cluster, transformer, RULES, LOSS = ns["cluster"], ns["transformer"], ns["RULES"], ns["LOSS"]


def report(tag, value):
    print(f"{tag} " + json.dumps(value), flush=True)


# ----- the same model on one device ------------------------------------------------
connected = keras.distribution.distribution()
keras.distribution.set_distribution(None)
keras.utils.set_random_seed(0)
with keras.RematScope(mode="activations"):
    single = transformer()
single.compile(keras.optimizers.AdamW(3e-3), LOSS)
tpu_keras.distributed_steps(single, grad_accum_steps=2)
same_data, _ = data.build(ns["config"].data, cluster, global_batch=32, training=True)
one_device = single.fit(same_data, epochs=3, steps_per_epoch=10, verbose=0)
report("SINGLE", {"mesh": ns["history"].history["loss"], "one_device": one_device.history["loss"],
                  "devices": sorted({len(w.value.sharding.device_set) for w in single.weights})})
keras.distribution.set_distribution(connected)

# ----- a rule removed ----------------------------------------------------------------
removed = [rule for rule in RULES if "mlp_up" not in rule.pattern]


initialized = []  # the shape of every kernel Keras initializes, recorded on the way in
glorot = keras.initializers.GlorotUniform.__call__
keras.initializers.GlorotUniform.__call__ = lambda self, shape, *args, **kwargs: (
    initialized.append(list(shape)) or glorot(self, shape, *args, **kwargs))
try:
    with cluster.layout(removed, replicate_below=4096):
        transformer()
    error = None
except tpu_keras.UserError as raised:
    error = str(raised)
keras.initializers.GlorotUniform.__call__ = glorot
report("REMOVED", {"error": error, "initialized": initialized,
                   "restored": keras.distribution.distribution() is connected})

# ----- a second model, other rules ----------------------------------------------------
layout_map = keras.distribution.LayoutMap(cluster.device_mesh)  # rules as Keras writes them
layout_map[r"block\d+_mlp_up/kernel"] = ("model", None)
with cluster.layout(layout_map, replicate_below=10**9):  # no other weight needs a rule
    second = transformer()


def spec(model, path):
    return str(next(w for w in model.weights if w.path == path).value.sharding.spec)


report("SECOND", {"first": spec(ns["model"], "block0_mlp_up/kernel"),
                  "second": spec(second, "block0_mlp_up/kernel"),
                  "restored": keras.distribution.distribution() is connected})

# ----- accumulation: 4 micro-batches of 16 against one batch of 64 ---------------------
rng = np.random.default_rng(0)
x = rng.integers(0, 256, (64, 64)).astype("int32")
y = rng.integers(0, 256, (64, 64)).astype("int32")
initial, updated = None, {}
for steps in (1, 4):
    with cluster.layout(RULES, replicate_below=4096):
        model = transformer()
        model.compile(keras.optimizers.SGD(0.5), LOSS)  # an update in proportion to the gradient
    initial = initial or model.get_weights()
    model.set_weights(initial)
    tpu_keras.distributed_steps(model, grad_accum_steps=steps)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    updated[steps] = model.get_weights()
largest = lambda a, b: max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))  # noqa: E731
report("ACCUM", {"between": largest(updated[1], updated[4]), "moved": largest(updated[1], initial),
                 "fsdp": spec(model, "block0_mlp_up/kernel")})

# ----- the plan, against the CLI's plan of the model registered as a builder ----------
from tpu_keras import config as tk_config  # noqa: E402
from tpu_keras.planning import reports, slice_plan  # noqa: E402

tpu_keras.models.register("transformer", loss=lambda: LOSS, metrics=lambda: [], headline="loss",
                          layout=lambda kwargs: RULES)(transformer)
config = tk_config.defaults()
config.engine, config.mesh, config.model = "jax", dict(fsdp=2, model=2), {"name": "transformer"}
config.layout.replicate_below = 4096
config.train.update(batch_size=256, grad_accum_steps=2, remat="activations")
cli_plan = json.loads(json.dumps(slice_plan.plan(config, "v5p-64")))  # what --json prints
report("PLAN", {"user": json.loads(json.dumps(ns["plan"])), "cli": cli_plan,
                "printed": str(ns["plan"]) == reports.format_plan(cli_plan)})

# ----- XLA's check of the plan, from user code ----------------------------------------
measured = tpu_keras.plan_model(transformer, RULES, loss=LOSS, replicate_below=4096,
                                tpu="v5litepod-4", mesh=dict(fsdp=2, model=2), batch=16,
                                precision="float32", measure=True)  # the TPU compiler's
cpu = tpu_keras.plan_model(transformer, RULES, loss=LOSS, replicate_below=4096, tpu="v5litepod-4",
                           mesh=dict(fsdp=2, model=2), batch=16, precision="float32", measure=True,
                           compiler="cpu")
report("MEASURE", {"plan": measured["per_device"], "sent": measured["sent_per_step"],
                   "measured": measured["measured"], "cpu": cpu["measured"],
                   "restored": keras.distribution.distribution() is connected})


# ----- float16 loss scaling: plain Keras against the toolkit's step ---------------------
class Scales(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.scales = []

    def on_train_batch_end(self, batch, logs=None):
        self.model.jax_state_sync()  # Keras's jax loop writes the variables back here
        self.scales.append(float(self.model.optimizer.dynamic_scale.numpy()))


x = rng.normal(size=(20 * 16, 8)).astype("float32")
y = x.sum(axis=1, keepdims=True)
scaled = {}
for name in ("keras", "toolkit"):
    keras.distribution.set_distribution(None if name == "keras" else connected)
    # The toolkit's model: every weight whole on every device, the batch split over fsdp.
    with contextlib.nullcontext() if name == "keras" else cluster.layout([], replicate_below=10**9):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(16, activation="relu", dtype="mixed_float16"),
                                  keras.layers.Dense(1, dtype="mixed_float16")])
        # 2**24 times the loss overflows float16's 65504 in the backward pass.
        model.compile(keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.01), initial_scale=2.0**24, dynamic_growth_steps=4), "mse")
    if name == "toolkit":
        tpu_keras.distributed_steps(model)
    scales = Scales()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[scales])
    scaled[name] = {"scales": scales.scales, "updates": int(model.optimizer.iterations.numpy()),
                    "weights": model.get_weights()}
keras.distribution.set_distribution(connected)
report("SCALE", {**{name: {k: v for k, v in r.items() if k != "weights"} for name, r in scaled.items()},
                 "apart": largest(scaled["keras"]["weights"], scaled["toolkit"]["weights"])})
