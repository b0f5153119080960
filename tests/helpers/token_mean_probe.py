"""One token mean over a step (`tpu_keras.training.token_mean`), against numpy.

    python tests/helpers/token_mean_probe.py ENGINE

A tiny gpt takes one SGD step on 8 rows whose weights (the response tokens
of instruction data) are very unequal: 1 to 16 weighted targets a row, so
each replica and micro-batch holds another count. Split two ways (tf: 2
replicas x 2 micro-batches; jax: a mesh of data 2 x model 2, 2 micro-batches)
and whole (one device, one batch), from the same weights; and split again with
the head and loss in 4 pieces of the sequence (`train.loss_chunks`, "chunked").
Prints one line, `TOKENS {json}`: each step's logged loss against numpy's mean
over every weighted target (at the starting weights), the largest difference
between the updates' weights (split against whole, chunked against split, and
the largest update), and `evaluate`'s loss over two batches of unequal weights
against numpy's mean over both.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json  # noqa: E402
import sys  # noqa: E402

from tpu_keras.cluster import engine  # noqa: E402

engine_name = sys.argv[1]
engine.select(engine_name, 2 if engine_name == "tf" else 4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras.config import defaults  # noqa: E402
from tpu_keras.training.setup import build_model  # noqa: E402

LENGTH = 16
COUNTS = ([1, 16, 2, 15, 16, 1, 14, 3], [16, 16, 1, 1, 2, 2, 9, 4])  # weighted targets per row
rng = np.random.default_rng(0)


def batch(counts):
    tokens = rng.integers(0, 64, (len(counts), LENGTH + 1)).astype("int32")
    weights = np.zeros((len(counts), LENGTH), "float32")
    for row, count in enumerate(counts):
        weights[row, LENGTH - count:] = 1.0  # the response: the row's last targets
    return tokens[:, :-1], tokens[:, 1:], weights


def config_for(split: bool, chunks: int = 1):
    config = defaults()
    config.engine = engine_name
    config.model = dict(name="gpt", vocab_size=64, context_length=LENGTH, width=32, depth=1,
                        num_heads=2)
    config.train.update(optimizer="sgd", learning_rate=0.5, warmup_steps=0, clipnorm=0.0,
                        weight_decay=0.0, steps=10, batch_size=8, steps_per_execution=1,
                        grad_accum_steps=2 if split else 1, loss_chunks=chunks)
    if engine_name == "tf":  # 2 logical CPU devices in the process, one of them for "whole"
        config.cluster.update(strategy="mirrored" if split else "one_device", virtual_devices=2)
    else:
        config.cluster.strategy = "auto" if split else "one_device"
        config.mesh = dict(data=2, fsdp=1, model=2) if split else dict(data=1, fsdp=1, model=1)
    return config


def dataset(cluster, *batches):
    ds = tf.data.Dataset.from_tensor_slices(tuple(np.concatenate(parts) for parts in zip(*batches)))
    ds = ds.batch(8, drop_remainder=True)
    return cluster.strategy.experimental_distribute_dataset(ds) if cluster.strategy else ds


def token_mean(model, *batches):
    """numpy's mean cross-entropy over every weighted target of `batches`."""
    total = weight = 0.0
    for x, y, w in batches:
        logits = np.asarray(model.predict(x, verbose=0), "float64")
        shifted = logits - logits.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        nll = -np.take_along_axis(log_probs, y[..., None], -1)[..., 0]
        total, weight = total + (nll * w).sum(), weight + w.sum()
    return total / weight


train, other = batch(COUNTS[0]), batch(COUNTS[1])
result, weights, initial = {}, {}, None
for name, split, chunks in (("split", True, 1), ("chunked", True, 4), ("whole", False, 1)):
    config = config_for(split, chunks)
    cluster = tpu_keras.connect(config.cluster, engine=engine_name, mesh=config.mesh)
    keras.utils.set_random_seed(0)
    model = build_model(config, cluster)
    initial = initial or model.get_weights()
    model.set_weights(initial)
    result[f"{name}_evaluate"] = float(model.evaluate(dataset(cluster, train, other), verbose=0,
                                                      return_dict=True)["loss"])
    if not split:
        result["numpy"] = token_mean(model, train)
        result["numpy_evaluate"] = token_mean(model, train, other)
    history = model.fit(dataset(cluster, train), epochs=1, steps_per_epoch=1, verbose=0)
    result[f"{name}_loss"] = float(history.history["loss"][-1])
    weights[name] = model.get_weights()
    result["devices"] = result.get("devices") or cluster.num_replicas * (
        config.mesh["model"] if engine_name == "jax" else 1)
result["between_updates"] = max(float(np.max(np.abs(a - b))) for a, b in zip(weights["split"], weights["whole"]))
result["chunked_against_split"] = max(float(np.max(np.abs(a - b)))
                                      for a, b in zip(weights["chunked"], weights["split"]))
result["moved"] = max(float(np.max(np.abs(a - b))) for a, b in zip(weights["whole"], initial))
print("TOKENS " + json.dumps(result), flush=True)
