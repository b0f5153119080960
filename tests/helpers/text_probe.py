"""Runs on each simulated host: builds the toolkit's training pipeline over text
files (bytes tokenizer, packed), with the example log on, pulls one epoch, then
builds it again as a restart would (the process's opened sources forgotten),
resumed at the middle step, and pulls one batch. Used by test_data.py, via the
launcher; the test reads the logs.

    python tests/helpers/text_probe.py OUT GLOB[,GLOB...] GLOBAL_BATCH CONTEXT_LENGTH

Logs go to OUT/<glob index>/{epoch,resumed}/host<h>.txt; token counts are
shared in OUT/counts. A glob under a folder named 'instructions' is read as
prompts and responses (data.instructions), one under 'apart' as documents
packed apart (data.text.document_masks). Each PROBE line says how many
documents this host tokenized while the pipeline was built: on the first
build and on the restart. A glob under 'bad' holds a line without its
response: each host prints the error it stops on (PROBE_ERROR).
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import dataclasses
import json
import sys

from absl import logging
import ml_collections
import tensorflow as tf

import tpu_keras
from tpu_keras import config as config_lib, data
from tpu_keras.data import text, tokenizers
from tpu_keras.errors import UserError

TOKENIZED = []  # per tokenizer made: the documents (prompts and responses apart) it tokenized


def counting(make):
    """`tokenizers.make`, whose tokenizers count the documents they tokenize, each its own:
    a source's tokenizer tokenizes nothing but its count until its pipeline is iterated,
    while the pipelines already iterated read ahead with theirs."""
    def make_counting(config):
        tokenizer, slot = make(config), len(TOKENIZED)
        TOKENIZED.append(0)

        def count(rows):
            TOKENIZED[slot] += int(rows)
            return rows

        def tokenize(texts):
            seen = tf.numpy_function(count, [tf.shape(texts)[0]], tf.int32)
            with tf.control_dependencies([seen]):
                ragged = tokenizer.tokenize(texts)
                return ragged.with_flat_values(tf.identity(ragged.flat_values))
        return dataclasses.replace(tokenizer, tokenize=tokenize)
    return make_counting


def main(out, patterns, global_batch, context_length):
    logging.set_verbosity(logging.INFO)
    tokenizers.make = counting(tokenizers.make)
    cluster = tpu_keras.connect(ml_collections.ConfigDict({"strategy": "auto"}))
    for index, pattern in enumerate(patterns.split(",")):
        config = config_lib.defaults().data
        config.shuffle_buffer = 16
        config.tokens.update(context_length=context_length, counts=f"{out}/counts")
        if "/instructions/" in pattern or "/bad/" in pattern:
            config.instructions.files = pattern
        else:
            config.text.update(files=pattern, field="text", document_masks="/apart/" in pattern)
        if "/bad/" in pattern:
            try:
                data.build(config, cluster, global_batch, training=True)
            except UserError as error:
                print(f"PROBE_ERROR {cluster.host_index} {error}", flush=True)
            continue
        dataset, steps = data.build(config, cluster, global_batch, training=True, seed=3,
                                    example_log=f"{out}/{index}/epoch/host")
        first = TOKENIZED[-1]
        batches = iter(dataset)
        for _ in range(steps):
            next(batches)
        text._OPENED.clear()  # a restart: nothing of the first start but the files it wrote
        resumed, _ = data.build(config, cluster, global_batch, training=True, seed=3,
                                start_step=steps // 2, example_log=f"{out}/{index}/resumed/host")
        restart = TOKENIZED[-1]
        next(iter(resumed))
        print("PROBE " + json.dumps({"pattern": pattern, "host": cluster.host_index,
                                     "steps": steps, "tokenized": [first, restart]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
