"""Text from a trained language model: the latest checkpoint of a run, keras-hub's samplers.

`load(workdir)` rebuilds a run's model from its `config.json` on this
machine's first device and restores the newest checkpoint into it (the
checkpoint's own engine: TensorFlow's or Orbax's format); `sample` then
extends a prompt token by token with a keras-hub sampler. The model is
called on the whole (padded) sequence at each step, which works for any
model that maps token ids to logits (the `gpt` builder and keras-hub
causal LMs alike) at the cost of recomputing the prefix: fine for the
short texts a check of a run needs, not a serving path.
"""

import json
import os

from tpu_keras.errors import UserError

LM_HEADLINES = ("bits_per_byte", "bits_per_token")


def read_run_config(workdir: str):
    """The config a run in `workdir` wrote (over today's defaults, for keys an older run
    did not write), or a one-line error."""
    from tpu_keras import config as config_lib
    path = os.path.join(workdir, "config.json")
    if "://" in workdir:  # gs://: TensorFlow reads it (and brings Keras on its own backend)
        import tensorflow as tf
        exists, opener = tf.io.gfile.exists, tf.io.gfile.GFile
    else:  # read before Keras loads, so that the engine can still be chosen
        exists, opener = os.path.exists, open
    if not exists(path):
        raise UserError(f"{workdir} holds no training run (no config.json); give the --workdir "
                        "of a run of python -m tpu_keras.train")
    with opener(path) as file, config_lib.without_type_checks():
        config = config_lib.defaults()  # JSON has lists where the schema has tuples
        config.update(json.load(file))
    return config


def load(workdir: str, config):
    """(model, step): the run's model on one device, its newest checkpoint restored."""
    from tpu_keras import cluster as cluster_lib
    from tpu_keras import models
    from tpu_keras.training import checkpoint, defaults
    from tpu_keras.training.run import build_model

    builder, _ = models.registry.get(config.model)
    if builder.headline not in LM_HEADLINES:
        raise UserError(f"the run in {workdir} trained {config.model.name!r}, which is not a "
                        "language model; generate needs a run of gpt or a keras-hub causal LM")
    models.hub.prepare_preset(config.model, workdir, is_chief=True)  # a {workdir} preset
    config.mesh.update(slices=1, data=1, fsdp=1, model=1)
    config.cluster.update(strategy="one_device" if config.engine == "tf" else "auto",
                          virtual_devices=0)
    cluster = cluster_lib.connect(config.cluster, engine=config.engine, mesh=config.mesh)
    defaults.resolve(config, cluster)  # the dtype policy the run trained in
    model = build_model(config, cluster)
    saver = checkpoint.open_checkpointer(workdir, model, cluster)
    if saver.latest_saved_step() is None:
        raise UserError(f"{workdir} has no checkpoint yet; generate once the run has saved one")
    return model, saver.restore_latest()


def sample(model, prompt: bytes, max_length: int, temperature: float, top_k: int, seed: int) -> bytes:
    """`prompt` extended to `max_length` bytes (at most the model's context length)."""
    import keras
    import keras_hub
    import numpy as np
    context, vocabulary_size = model.input_shape[1], model.output_shape[-1]
    if not prompt:
        raise UserError("--prompt is empty; give the text to continue, such as --prompt='def '")
    outside = sorted({b for b in prompt if b >= vocabulary_size})
    if outside:
        raise UserError(f"the prompt has bytes {outside[:5]} outside the model's vocabulary of "
                        f"{vocabulary_size} tokens; use text the model was trained on")
    if not len(prompt) < max_length <= context:
        raise UserError(f"--max_length={max_length} must be above the prompt's {len(prompt)} "
                        f"bytes and at most the model's context length, {context}")
    if temperature == 0:
        sampler = keras_hub.samplers.GreedySampler()
    elif top_k:
        sampler = keras_hub.samplers.TopKSampler(k=top_k, temperature=temperature, seed=seed)
    else:
        sampler = keras_hub.samplers.RandomSampler(temperature=temperature, seed=seed)
    tokens = np.zeros((1, max_length), "int32")
    tokens[0, :len(prompt)] = list(prompt)
    given = np.zeros((1, max_length), bool)
    given[0, :len(prompt)] = True

    def next_logits(tokens, cache, index):
        padded = keras.ops.pad(tokens, [[0, 0], [0, context - max_length]])
        logits = model(padded, training=False)
        return keras.ops.take(logits, index - 1, axis=1), None, cache

    out = sampler(next_logits, keras.ops.convert_to_tensor(tokens), index=len(prompt),
                  mask=keras.ops.convert_to_tensor(given), model=model)
    return bytes(int(t) for t in keras.ops.convert_to_numpy(out)[0])
