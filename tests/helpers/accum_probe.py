"""One update with gradient accumulation against one update on the whole batch.

    python tests/helpers/accum_probe.py ENGINE DATA_DIR [REPLICAS]

The tiny gpt (no dropout) from the same initial weights takes one step on
the same 4 x 16 examples: once as one batch, once as 4 micro-batches of 16
(`train.grad_accum_steps=4`). Prints one JSON line: the largest difference
between the two models' weights, and between each and the initial ones.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json
import sys

engine_name, data_dir = sys.argv[1], sys.argv[2]
replicas = int(sys.argv[3]) if len(sys.argv) > 3 else 0

from tpu_keras.cluster import engine  # noqa: E402

engine.select(engine_name, replicas)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras import data  # noqa: E402
from tpu_keras.training.setup import build_model  # noqa: E402

sys.path.insert(0, "configs")
import lm_stdlib  # noqa: E402

results, initial = {}, None
for accumulate in (1, 4):
    keras.backend.clear_session()
    config = lm_stdlib.get_config("tiny")
    config.data.data_dir = data_dir
    config.cluster.virtual_devices = replicas
    config.train.update(batch_size=64 // accumulate, grad_accum_steps=accumulate, warmup_steps=0,
                        steps_per_execution=1)
    cluster = tpu_keras.connect(config.cluster, engine=engine_name, mesh=config.mesh)
    keras.utils.set_random_seed(0)
    model = build_model(config, cluster)
    if initial is None:
        initial = model.get_weights()
    model.set_weights(initial)
    batches, _ = data.build(config.data, cluster, 64, training=True)
    model.fit(batches, steps_per_epoch=1, epochs=1, verbose=0)
    results[accumulate] = model.get_weights()
largest = lambda a, b: max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
print("ACCUM " + json.dumps({"between": largest(results[1], results[4]),
                             "moved": largest(results[1], initial)}), flush=True)
