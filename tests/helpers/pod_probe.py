"""Trains a config's model a few steps on the same global batches, on one device or on a
simulated pod, and reports the losses and where the batch rows and weights live.

    python tests/helpers/pod_probe.py CONFIG INIT.npz
    python -m tpu_keras.launch --tpu=v5litepod-16 -- python tests/helpers/pod_probe.py CONFIG INIT.npz
    python -m tpu_keras.launch --tpu=2xv4-16 -- python tests/helpers/pod_probe.py CONFIG INIT.npz

CONFIG is `digits` (the tiny MLP, its hidden kernels split over fsdp=2 on a
pod) or `lm` (`configs/lm_stdlib.py:tiny`, the default mesh). On a pod of several slices the mesh has `mesh.slices` of them. The run's own data
pipeline gives each host a shuffle of its own share of the examples, so
batches depend on the number of hosts; here every global batch is the same
numpy rows whatever the layout, and each host feeds the rows of it that its
devices hold (`mesh.feed_rows`: on a TPU's chip order, rows far apart). The
first run saves its initial weights to INIT.npz, later ones load them.
Prints one `POD {json}` line per process: losses, this host's slice, the slice
of each row of the device grid and the processes whose devices it holds, each
weight's spec.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json
import os
import sys

from tpu_keras.cluster import engine

engine.select("jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, "configs")
import digits  # noqa: E402
import lm_stdlib  # noqa: E402
from probe_run import built_from_shared_init  # noqa: E402

from tpu_keras.parallelism import mesh as mesh_lib  # noqa: E402

STEPS = 5
name, init_path = sys.argv[1], sys.argv[2]
launched = int(os.environ.get("TPU_KERAS_NUM_SLICES", 0) or 0)
on_a_pod = int(os.environ.get("TPU_KERAS_VIRTUAL_DEVICES", 1)) > 1  # set by the launcher

rng = np.random.default_rng(0)
if name == "digits":
    config, global_batch = digits.get_config("tiny"), 32
    config.layout.replicate_below = 1024  # the hidden kernels (64x256, 256x256) split over fsdp
    if on_a_pod:
        config.mesh.update(slices=launched or 1, fsdp=2)
    inputs = rng.random((STEPS, global_batch, 8, 8, 1), dtype=np.float32)
    targets = rng.integers(0, 10, (STEPS, global_batch)).astype(np.int32)
else:
    assert name == "lm", name
    config, global_batch = lm_stdlib.get_config("tiny"), 16
    context = config.model.context_length
    tokens = rng.integers(0, 256, (STEPS, global_batch, context + 1)).astype(np.int32)
    inputs, targets = tokens[..., :-1], tokens[..., 1:]
config.engine = "jax"
model, cluster = built_from_shared_init(config, "jax", init_path)

by_name = {f"{d.platform}:{d.id}": d for d in jax.devices()}
grid = np.vectorize(by_name.__getitem__, otypes=[object])(cluster.device_mesh.devices)
rows = mesh_lib.batch_rows(grid, mesh_lib.row_devices(cluster.mesh))
mine = mesh_lib.feed_rows(rows, global_batch)[jax.process_index()]
local = tf.data.Dataset.from_tensor_slices((inputs[:, mine], targets[:, mine])).repeat()
# JAX places this host's rows where `feed_rows` says: the first global batch, as the mesh splits it.
batch_split = jax.sharding.NamedSharding(jax.sharding.Mesh(grid, mesh_lib.AXES),
                                         jax.sharding.PartitionSpec(mesh_lib.BATCH_AXES))
placed = jax.make_array_from_process_local_data(batch_split, inputs[0][mine])
rows_agree = all(np.array_equal(np.asarray(shard.data), inputs[0][shard.index])
                 for shard in placed.addressable_shards)
history = model.fit(local, steps_per_epoch=1, epochs=STEPS, verbose=0)

print("POD " + json.dumps({
    "mesh": cluster.mesh,
    "host": cluster.host_index,
    "slice": int(os.environ.get("TPU_KERAS_SLICE", 0)),
    "pipelines": [cluster.input_pipelines, cluster.input_index],
    "batch_rows": list(rows[jax.process_index()]),
    "rows_agree": rows_agree,
    "rows": [{"slice": mesh_lib.slice_of_row(r, cluster.mesh),
              "processes": sorted({d.process_index for d in row.flat})}
             for r, row in enumerate(grid)],
    "losses": [float(x) for x in history.history["loss"]],
    # The update is real, and the same: how far the weights moved, and where to (summed
    # where they live: a weight split over fsdp spans two hosts).
    "moved": sum(float(keras.ops.sum(keras.ops.abs(w.value - w0)))
                 for w, w0 in zip(model.weights, np.load(init_path).values())),
    "weights_sum": sum(float(keras.ops.sum(w.value)) for w in model.weights),
    "specs": {v.path: [a if isinstance(a, (str, type(None))) else list(a)
                       for a in getattr(v.value.sharding, "spec", ())] for v in model.weights},
}), flush=True)
