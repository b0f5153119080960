"""The one place where a split is divided per host and a batch per replica.

`build()` returns a dataset made with `strategy.distribute_datasets_from_function`:
TensorFlow calls the function from `dataset_fn()` once per input pipeline (one
per host) with an `InputContext`. Each host reads its share of the files (see `file_shards`), and every batch
it yields goes to one of its replicas. On the jax engine the host's pipeline
yields the host's whole share of the global batch, which Keras lays out
over the host's devices with `jax.make_array_from_process_local_data`.

Training sees each example exactly once per epoch: an epoch is a seeded
shuffle of the host's share, cut to the number of steps every host can fill.
Evaluation sees every example exactly once: the last batches are padded to
the static shape with rows of weight 0.

Batch `k` of a run is a function of (seed, host, k) alone, so a resumed run
rebuilds its input position from the step instead of saving an iterator. A
batch that made the loss non-finite can be left out for good (`skip`): the
run then trains on the next one in its place. With `example_log`, each host
appends the ids of the examples in every training batch it builds to a file
(`position id id ...`), to audit that none is lost or repeated.
"""

import os

from absl import logging
import tensorflow as tf

from tpu_keras import data_section, workdir
from tpu_keras.data import file_shards, iterator_reaper, preferences, sources, text
from tpu_keras.data.preprocess import PREPROCESSORS
from tpu_keras.errors import UserError, closest

AUTOTUNE = tf.data.AUTOTUNE
# Set by `python -m tpu_keras.launch --data_service` for its hosts.
SERVICE_ENV = "TPU_KERAS_DATA_SERVICE"
_ENDLESS = 2 ** 62


def build(config, cluster, global_batch: int, *, training: bool, seed: int = 0,
          start_step: int = 0, max_eval_steps: int = 0, skip=(), example_log: str = ""):
    """Returns `(distributed_dataset, steps)`; see `dataset_fn` for the arguments."""
    fn, steps = dataset_fn(config, cluster, global_batch, training=training, seed=seed,
                           start_step=start_step, max_eval_steps=max_eval_steps, skip=skip,
                           example_log=example_log)
    if cluster.strategy is None:  # jax: this host's pipeline, as Keras expects it
        dataset = fn(tf.distribute.InputContext(cluster.input_pipelines, cluster.input_index,
                                                cluster.num_replicas))
    else:
        dataset = cluster.strategy.distribute_datasets_from_function(fn)
    # Deleting an iterator can block for up to a minute: never on the training thread.
    return iterator_reaper.release_off_thread(dataset), steps


def dataset_fn(config, cluster, global_batch: int, *, training: bool, seed: int = 0,
               start_step: int = 0, max_eval_steps: int = 0, skip=(), example_log: str = ""):
    """Returns `(fn, steps)`: `fn(InputContext)` builds one host's tf.data pipeline.

    For training, `steps` is the number of steps in one epoch and the data
    repeats forever, starting at `start_step` (so a resumed run continues
    where it stopped) and leaving out the batch positions in `skip`; for
    evaluation it is the number of steps that covers the whole split, or
    `max_eval_steps` if that is smaller (the same batches every time).
    `example_log` is a file name prefix: training appends the example ids
    of every batch to `<example_log><host>.txt`.
    """
    if global_batch % cluster.num_replicas:
        raise UserError(
            f"train.batch_size={global_batch} does not divide across {cluster.num_replicas} "
            f"replicas; use a multiple of {cluster.num_replicas}")
    # Packed text is token sequences: next_token unless the config says otherwise.
    kind = data_section.kind(config)
    name = config.preprocess or (preferences.PREPROCESSOR if kind == "preferences" else
                                 "next_token" if kind in data_section.TOKENIZED else "")
    if kind == "preferences" and name != preferences.PREPROCESSOR:
        raise UserError(f"data.preprocess={name!r} with data.preferences: preference pairs are "
                        f"read by {preferences.PREPROCESSOR!r}; set data.preprocess to ''")
    if name not in PREPROCESSORS:
        raise UserError(f"data.preprocess={name!r} is not one of "
                        f"{sorted(PREPROCESSORS)}{closest(name, PREPROCESSORS)}")
    preprocess = PREPROCESSORS[name](config)
    service_address = config.service_address or os.environ.get(SERVICE_ENV, "")
    if kind == "preferences":
        source = preferences.open_source(config, training)
    elif kind in data_section.TOKENIZED:
        source = text.open_source(config, training, (cluster.host_index, cluster.num_processes))
    else:
        source = sources.open_source(config, training)
    plan = file_shards.plan(source, cluster.input_pipelines)
    per_replica = global_batch // cluster.num_replicas
    per_host = global_batch // cluster.input_pipelines
    # A tf.distribute strategy takes one replica's batch at a time, Keras on jax a host's.
    per_yield = per_replica if cluster.strategy is not None else per_host
    steps = plan.train_steps(per_host) if training else plan.eval_steps(per_host)
    if not training and max_eval_steps:
        steps = min(steps, max_eval_steps)
    if steps == 0:
        raise UserError(f"{source.name} gives each host fewer than {per_host} examples, one "
                        f"batch; use a smaller train.batch_size or more data")

    def host_dataset(context: tf.distribute.InputContext) -> tf.data.Dataset:
        host = context.input_pipeline_id
        if training:
            ds = _epochs(plan, host, config, preprocess, per_yield, per_host // per_yield,
                         steps, seed, start_step, sorted(skip),
                         f"{example_log}{host}.txt" if example_log else "")
        else:
            examples = plan.read(host, config.deterministic)
            ds = _padded(examples.map(preprocess, num_parallel_calls=AUTOTUNE), steps * per_host)
            ds = ds.batch(per_yield, drop_remainder=True)
        if service_address:
            # OFF: the service runs this host's pipeline as it is, so the
            # sharding above (and exactly-once) holds unchanged.
            ds = ds.apply(tf.data.experimental.service.distribute(
                processing_mode=tf.data.experimental.service.ShardingPolicy.OFF,
                service=service_address))
        options = tf.data.Options()
        options.deterministic = config.deterministic
        return ds.with_options(options).prefetch(AUTOTUNE)

    logging.info("data: %s, global batch %d = %d replica(s) x %d, %d steps per %s%s",
                 source.name, global_batch, cluster.num_replicas, per_replica, steps,
                 "epoch" if training else "evaluation",
                 f", through the tf.data service at {service_address}" if service_address else "")
    return host_dataset, steps


def _epoch_seeds(seed: int, host: int, epoch):
    """Stateless seeds of one epoch: file order (the same on every host), example order."""
    epoch = tf.cast(epoch, tf.int64)
    return (tf.stack([tf.constant(seed, tf.int64), epoch]),
            tf.stack([tf.constant(seed * 1_000_003 + host + 1, tf.int64), epoch]))


def _epochs(plan, host, config, preprocess, batch, batches_per_step, steps_per_epoch, seed,
            start_step, skip, example_log):
    """Endless epochs of `steps_per_epoch` x `batches_per_step` batches of `batch`
    examples, each epoch shuffled anew from (seed, host, epoch).

    The shuffle is stateless, so epoch k is the same whether a run reaches it
    or resumes in it. Preprocessing runs on whole blocks. With `data.cache`
    the preprocessed blocks are kept in memory after the first epoch (for
    splits that fit); the file order is then fixed and only the example order
    changes. Example ids, when logged, travel beside each block.
    """
    with_ids = bool(example_log)
    if with_ids:
        example_log = workdir.absolute(example_log)
        tf.io.gfile.makedirs(os.path.dirname(example_log))

    def blocks(order_seed=None):
        examples = plan.read(host, config.deterministic, order_seed=order_seed, with_ids=with_ids)
        examples = examples.batch(config.shuffle_buffer)
        if with_ids:
            return examples.map(lambda block, ids: (preprocess(block), ids),
                                num_parallel_calls=AUTOTUNE)
        return examples.map(preprocess, num_parallel_calls=AUTOTUNE)

    cached = blocks().cache() if config.cache else None

    def one_epoch(epoch):
        file_seed, example_seed = _epoch_seeds(seed, host, epoch)
        epoch_blocks = cached if cached is not None else blocks(file_seed)
        examples = _shuffle_blocks(epoch_blocks, example_seed)
        return examples.rebatch(batch, drop_remainder=True).take(steps_per_epoch * batches_per_step)

    start = position_of_step(start_step, skip)
    first_epoch, position_in_epoch = divmod(start, steps_per_epoch)
    epochs = tf.data.Dataset.range(first_epoch, _ENDLESS).flat_map(one_epoch)
    batches = epochs.skip(position_in_epoch * batches_per_step)
    if not skip and not with_ids:
        return batches
    # Each batch with its position: the step it feeds when nothing is skipped.
    positions = tf.data.Dataset.range(start * batches_per_step, _ENDLESS).map(
        lambda i: i // batches_per_step)
    batches = tf.data.Dataset.zip(positions, batches)
    if skip:
        skipped = tf.constant(skip, tf.int64)
        batches = batches.filter(lambda position, _: tf.reduce_all(position != skipped))
    if with_ids:
        def log(position, element):
            examples, ids = element
            tf.print(position, ids, output_stream=f"file://{example_log}",
                     summarize=-1)
            return examples
        return batches.map(log)
    return batches.map(lambda position, examples: examples)


def position_of_step(step: int, skip) -> int:
    """The position of the batch that step `step` (0-based) trains on, given skipped positions."""
    position = step
    for skipped in sorted(skip):
        if skipped <= position:
            position += 1
    return position


def _shuffle_blocks(blocks, seed):
    """Permutes the examples inside each block by a stateless shuffle.

    Like a shuffle buffer of the block's size in memory and mixing, but a
    function of `seed` alone, which `Dataset.shuffle` inside `flat_map` cannot
    be; and it stays batched, so no per-example work is added.
    """
    def permute(index, block):
        count = tf.shape(tf.nest.flatten(block)[0])[0]
        order = tf.random.experimental.stateless_shuffle(
            tf.range(count), tf.random.experimental.stateless_fold_in(seed, index))
        return tf.nest.map_structure(lambda t: tf.gather(t, order), block)
    return blocks.enumerate().map(permute, num_parallel_calls=AUTOTUNE)


def _padded(examples, size):
    """Adds weight 1 to every target (unless the preprocessor gave weights) and pads with
    weight-0 copies of zeros to `size`.

    Weights have the targets' shape (one per token for a language model), so
    Keras's weighted metrics count real targets only.
    """
    weighted = examples.map(lambda x, y, *w: (x, y, w[0] if w else tf.ones_like(y, tf.float32)))
    zeros = tf.nest.map_structure(lambda spec: tf.zeros(spec.shape, spec.dtype),
                                  weighted.element_spec)
    padding = tf.data.Dataset.from_tensors(zeros).repeat()
    return weighted.concatenate(padding).take(size)
