"""A long sequence's training step with the whole logits and with `train.loss_chunks`, side by side.

    python scripts/long_context.py [--length=2048] [--chunks=8] [--rounds=4]
    (benchmark.py --long_context runs it)

One keras-hub Llama of a large vocabulary (32,768 entries, 2 layers of 256)
built by the toolkit on the jax engine, as `train` builds it, twice: with
its head and loss over the whole sequence (`train.loss_chunks=1`), and in
`--chunks` pieces. Each variant's loss and gradients (the toolkit's own
`compute_loss_and_updates`, jitted) from the same weights and tokens: the
step time (in turns, benchmark_timing.race; the median of each) and the
memory the step needs beyond its arguments, by XLA's memory analysis of the
compiled program (`temp_size_in_bytes`: the activations, the logits among
them), for this CPU and, compiled by libtpu, for one TPU v5e chip. Also the
largest difference between the two losses and gradients. Prints JSON; quote
the ratios (`chunked_over_whole`).
"""

import json
import os
import statistics
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

import benchmark_timing as timing  # noqa: E402  (beside this script)

_LENGTH = flags.DEFINE_integer("length", 2048, "Tokens per sequence.")
_BATCH = flags.DEFINE_integer("batch", 2, "Sequences per step.")
_VOCABULARY = flags.DEFINE_integer("vocabulary", 32768, "Entries of the vocabulary.")
_CHUNKS = flags.DEFINE_integer("chunks", 8, "train.loss_chunks of the chunked variant.")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "Turns each variant gets (an even number).")
_SECONDS = flags.DEFINE_float("seconds", 3.0, "Time spent measuring each turn.")


def config_of(chunks: int):
    from tpu_keras.config import defaults
    config = defaults()
    config.engine = "jax"
    config.model = dict(name="keras_hub:LlamaCausalLM", vocabulary_size=_VOCABULARY.value, num_layers=2,
                        hidden_dim=256, num_query_heads=4, num_key_value_heads=2, intermediate_dim=512,
                        context_length=_LENGTH.value)
    config.train.update(loss_chunks=chunks, batch_size=_BATCH.value, precision="float32")
    return config


def step_function(chunks: int, weights=None):
    """(the jitted loss-and-gradients of the toolkit's model, its arguments, its weights)."""
    import jax
    import keras
    import numpy as np
    import tpu_keras
    from tpu_keras.training import jax_steps
    from tpu_keras.training.setup import build_model
    config = config_of(chunks)
    cluster = tpu_keras.connect(config.cluster, engine="jax", mesh=config.mesh)
    keras.utils.set_random_seed(0)
    model = build_model(config, cluster)
    if weights is not None:
        model.set_weights(weights)
    tokens = np.random.default_rng(0).integers(0, _VOCABULARY.value, (_BATCH.value, _LENGTH.value + 1))
    x, y = tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")
    model.optimizer.build(model.trainable_variables)
    state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
             [v.value for v in model.metrics_variables], [v.value for v in model.optimizer.variables])

    def loss_and_gradients(trainable, non_trainable, metrics, optimizer, x, y):
        (loss, _), gradients = jax.value_and_grad(jax_steps._with_load(model.compute_loss_and_updates),
                                                  has_aux=True)(
            trainable, non_trainable, metrics, x, y, None, training=True, optimizer_variables=optimizer)
        return loss, gradients
    return jax.jit(loss_and_gradients), (*state, x, y), model.get_weights()


def tpu_temporaries(function, arguments) -> int:
    """The step's temporaries compiled for one TPU v5e chip by libtpu (no chip needed)."""
    import jax
    import numpy as np
    whole = timing.one_tpu_chip()
    shaped = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=whole), arguments)
    return int(function.lower(*shaped).compile().memory_analysis().temp_size_in_bytes)


def main(argv):
    del argv
    import jax
    import numpy as np
    whole, arguments, weights = step_function(1)
    chunked, _, _ = step_function(_CHUNKS.value, weights)
    made = {"whole": whole, "chunked": chunked}
    results = {name: function(*arguments) for name, function in made.items()}
    gap = lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    gradient_gap = max(gap(a, b) for a, b in zip(results["whole"][1], results["chunked"][1]))
    gradient_scale = max(float(np.max(np.abs(np.asarray(g)))) for g in results["whole"][1])
    rates = timing.race({name: (lambda name=name: 1.0 / timing.median_seconds(made[name], arguments,
                                                                       _SECONDS.value))
                         for name in made}, _ROUNDS.value)
    step = {name: 1.0 / statistics.median(rates[name]) for name in made}
    cpu = {name: int(f.lower(*arguments).compile().memory_analysis().temp_size_in_bytes)
           for name, f in made.items()}
    tpu = {name: tpu_temporaries(f, arguments) for name, f in made.items()}
    logits = _BATCH.value * _LENGTH.value * _VOCABULARY.value * 4
    print(json.dumps({
        "device": jax.devices()[0].device_kind, "batch": _BATCH.value, "length": _LENGTH.value,
        "vocabulary": _VOCABULARY.value, "chunks": _CHUNKS.value, "logits_bytes": logits,
        "step_seconds": step, "chunked_over_whole": step["chunked"] / step["whole"],
        "cpu_temporary_bytes": {**cpu, "chunked_over_whole": cpu["chunked"] / cpu["whole"]},
        "tpu_v5e_temporary_bytes": {**tpu, "chunked_over_whole": tpu["chunked"] / tpu["whole"]},
        "loss_difference": gap(results["whole"][0], results["chunked"][0]),
        "relative_gradient_difference": gradient_gap / gradient_scale}, indent=2))


if __name__ == "__main__":
    app.run(main)
