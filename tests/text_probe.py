"""Runs on each simulated host: builds the toolkit's training pipeline over text
files (bytes tokenizer, packed), with the example log on, pulls one epoch, then
builds it again resumed at the middle step and pulls one batch. Used by
test_data.py, via the launcher; the test reads the logs.

    python tests/text_probe.py OUT GLOB[,GLOB...] GLOBAL_BATCH CONTEXT_LENGTH

Logs go to OUT/<glob index>/{epoch,resumed}/host<h>.txt.
"""

import json
import sys

from absl import logging
import ml_collections

import tpu_keras
from tpu_keras import config as config_lib, data


def main(out, patterns, global_batch, context_length):
    logging.set_verbosity(logging.INFO)
    cluster = tpu_keras.connect(ml_collections.ConfigDict({"strategy": "auto"}))
    for index, pattern in enumerate(patterns.split(",")):
        config = config_lib.defaults().data
        config.update(text_files=pattern, text_field="text", context_length=context_length,
                      shuffle_buffer=16)
        dataset, steps = data.build(config, cluster, global_batch, training=True, seed=3,
                                    example_log=f"{out}/{index}/epoch/host")
        batches = iter(dataset)
        for _ in range(steps):
            next(batches)
        resumed, _ = data.build(config, cluster, global_batch, training=True, seed=3,
                                start_step=steps // 2, example_log=f"{out}/{index}/resumed/host")
        next(iter(resumed))
        print("PROBE " + json.dumps({"pattern": pattern, "host": cluster.host_index,
                                     "steps": steps}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
