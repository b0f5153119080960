"""Trains the digits MLP a few steps on the same global batches, on one device or on a
simulated multislice pod, and reports the losses and where the weights live.

    python tests/slice_probe.py INIT.npz
    python -m tpu_keras.launch --slices=2 --hosts=2 --devices_per_host=2 -- \
        python tests/slice_probe.py INIT.npz

Under the launcher the mesh is `mesh.slices=2, fsdp=2` (data=2 in each slice);
alone, one device. The run's own data pipeline gives each host a shuffle of
its own share of the examples, so batches depend on the number of hosts;
here every global batch is the same numpy rows whatever the layout, and each
host feeds the rows of it that its devices hold. The first run saves its
initial weights to INIT.npz, later ones load them. Prints one `SLICES {json}`
line per process: losses, this host's slice, the slice each row of the device
grid belongs to and the processes whose devices it holds, each weight's spec.
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
from probe_run import built_from_shared_init  # noqa: E402

from tpu_keras.parallelism import mesh as mesh_lib  # noqa: E402

STEPS, GLOBAL_BATCH = 5, 32
init_path = sys.argv[1]
launched = int(os.environ.get("TPU_KERAS_NUM_SLICES", 0) or 0)

config = digits.get_config("tiny")
config.engine = "jax"
config.layout.replicate_below = 1024  # the hidden kernels (64x256, 256x256) split over fsdp
if launched:
    config.mesh.update(slices=launched, fsdp=2)
model, cluster = built_from_shared_init(config, "jax", init_path)

rng = np.random.default_rng(0)
images = rng.random((STEPS, GLOBAL_BATCH, 8, 8, 1), dtype=np.float32)
labels = rng.integers(0, 10, (STEPS, GLOBAL_BATCH)).astype(np.int32)
per_host = GLOBAL_BATCH // cluster.input_pipelines
rows = slice(cluster.input_index * per_host, (cluster.input_index + 1) * per_host)
local = tf.data.Dataset.from_tensor_slices((images[:, rows], labels[:, rows])).repeat()
history = model.fit(local, steps_per_epoch=1, epochs=STEPS, verbose=0)

grid = cluster.device_mesh.devices  # 'cpu:ID' names, (slices x data, fsdp, model)
process_of = {f"{d.platform}:{d.id}": d.process_index for d in jax.devices()}
print("SLICES " + json.dumps({
    "mesh": cluster.mesh,
    "host": cluster.host_index,
    "slice": int(os.environ.get("TPU_KERAS_SLICE", 0)),
    "rows": [{"slice": mesh_lib.slice_of_row(r, cluster.mesh),
              "processes": sorted({process_of[name] for name in row.flat})}
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
