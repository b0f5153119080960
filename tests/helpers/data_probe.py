"""Runs on each simulated host: builds the toolkit's training pipeline over TFRecord
files whose examples carry a unique id, and prints which ids each of this host's
replicas received in the first epochs. Used by test_data.py, via the launcher.

    python tests/helpers/data_probe.py GLOB[,GLOB...] GLOBAL_BATCH EPOCHS SEED[,SEED...]

One PROBE line per glob and seed: several file sets, or several builds of
one pipeline, share one start of every host.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json
import sys

from absl import logging
import ml_collections

import tpu_keras
from tpu_keras import config as config_lib, data


def main(patterns, global_batch, epochs, seeds):
    logging.set_verbosity(logging.INFO)  # the sharding decision is logged at INFO
    cluster = tpu_keras.connect(ml_collections.ConfigDict({"strategy": "auto"}))
    for pattern in patterns.split(","):
        for run, seed in enumerate(seeds.split(",")):
            report(cluster, pattern, global_batch, epochs, int(seed), run)


def report(cluster, pattern, global_batch, epochs, seed, run):
    config = config_lib.defaults().data
    config.tfrecords.update(files=pattern, features={"id": "int64", "x": "float32[2]"})
    config.update(preprocess="features", inputs="x", targets="id", shuffle_buffer=64)
    dataset, steps = data.build(config, cluster, global_batch, training=True, seed=seed)
    batches = iter(dataset)
    seen = [[[] for _ in range(cluster.replicas_per_host)] for _ in range(epochs)]
    for epoch in range(epochs):
        for _ in range(steps):
            _, ids = next(batches)
            for replica, local in enumerate(cluster.strategy.experimental_local_results(ids)):
                seen[epoch][replica].extend(int(i) for i in local.numpy())
    print("PROBE " + json.dumps({"pattern": pattern, "run": run, "host": cluster.host_index,
                                 "hosts": cluster.num_hosts, "steps": steps, "seen": seen}),
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
