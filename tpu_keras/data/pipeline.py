"""The one place where a split is divided per host and a batch per replica.

`build()` returns a distributed dataset made with
`strategy.distribute_datasets_from_function`: TensorFlow calls our
`dataset_fn` once per input pipeline (one per host), with an `InputContext`
that says which pipeline it is and how many replicas it feeds.
"""

import os

from absl import logging
import tensorflow as tf
import tensorflow_datasets as tfds

from tpu_keras.data import builders
from tpu_keras.data.preprocess import PREPROCESSORS
from tpu_keras.errors import UserError, closest

AUTOTUNE = tf.data.AUTOTUNE


def build(config, cluster, global_batch: int, *, training: bool, seed: int = 0):
    """Returns `(distributed_dataset, steps)` for the train or eval split.

    Training data repeats forever (steps is None); eval data gives exactly
    `steps` global batches on every host, so no host waits on another.
    """
    if global_batch % cluster.num_replicas:
        raise UserError(
            f"train.batch_size={global_batch} does not divide across {cluster.num_replicas} "
            f"replicas; use a multiple of {cluster.num_replicas}")
    if config.preprocess not in PREPROCESSORS:
        raise UserError(f"data.preprocess={config.preprocess!r} is not one of "
                        f"{sorted(PREPROCESSORS)}{closest(config.preprocess, PREPROCESSORS)}")
    builder = _builder(config.name, os.path.expanduser(config.data_dir))
    split = config.train_split if training else config.eval_split
    if split not in builder.info.splits:
        raise UserError(f"dataset {config.name!r} has no split {split!r}; it has "
                        f"{sorted(builder.info.splits)}")
    num_files = builder.info.splits[split].num_shards
    steps = None if training else builder.info.splits[split].num_examples // global_batch
    if steps == 0:
        raise UserError(f"split {split!r} of {config.name!r} has fewer examples than one "
                        f"global batch of {global_batch}; use a smaller train.batch_size")

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        per_replica = context.get_per_replica_batch_size(global_batch)
        by_file = num_files >= context.num_input_pipelines
        read_config = tfds.ReadConfig(
            input_context=context if by_file else None,
            shuffle_seed=seed + context.input_pipeline_id,
            interleave_cycle_length=min(16, num_files))
        ds = builder.as_dataset(split=split, shuffle_files=training, read_config=read_config)
        if not by_file:
            ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
        ds = ds.map(PREPROCESSORS[config.preprocess], num_parallel_calls=AUTOTUNE)
        if training:
            ds = ds.repeat().shuffle(config.shuffle_buffer, seed=seed + context.input_pipeline_id)
        else:
            # Repeating before `take` keeps every host at exactly `steps` batches.
            ds = ds.repeat()
        ds = ds.batch(per_replica, drop_remainder=True)
        if not training:
            ds = ds.take(steps)
        return ds.prefetch(AUTOTUNE)

    logging.info("data: %s[%s] from %d file(s), global batch %d over %d replica(s)",
                 config.name, split, num_files, global_batch, cluster.num_replicas)
    return cluster.strategy.distribute_datasets_from_function(dataset_fn), steps


def _builder(name: str, data_dir: str):
    if not name:
        raise UserError("data.name is empty; set it to a TFDS name such as 'stdlib_bytes' or 'digits'")
    try:
        return builders.prepare(name, data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        known = sorted(builders.OFFLINE_BUILDERS) + ["any TFDS dataset prepared under data.data_dir"]
        raise UserError(f"unknown dataset {name!r}{closest(name.split('/')[0], tfds.list_builders())}; "
                        f"use one of {known}") from None
