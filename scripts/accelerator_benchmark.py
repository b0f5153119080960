"""`benchmark.py --accelerator`: the jax engine next to plain Keras on JAX, on this machine's GPU or TPU.

For each config (the default `lm_stdlib`, and `lm_stdlib:1b`, a gpt of about
a billion parameters), both in mixed_bfloat16 since the peak is a bf16 peak,
the toolkit's model as a run builds and compiles it on the jax engine, and
plain Keras on JAX (the same model,
optimizer, precision, batch and steps per call; `jit_compile=True`), take
turns for `rounds` rounds from the same initial weights; each reports the
median examples/s and the MFU: model FLOP/s (`tpu_keras.measurement.flops`)
over the published dense bf16 peak of the devices
(`tpu_keras.measurement.peak.published_bf16_peak`).

The batches are synthetic tokens from numpy, one batch repeated, not the
run's tf.data pipeline: the step alone is timed, and the code path needs no
TensorFlow (GPU images often carry JAX and Keras only). The JSON says
whether TensorFlow got imported all the same. A batch that does not fit in
the devices' memory is halved until one does (the 1b config starts at 8
sequences of 2,048 tokens per device: the run's 512 is a pod's batch).
"""

import datetime
import gc
import statistics
import sys

import benchmark_timing as timing

DEFAULT_CONFIGS = ("lm_stdlib", "lm_stdlib:1b")
BATCH_PER_DEVICE = {"lm_stdlib:1b": 8}  # where the config's own batch is a pod's


def accelerator_platform(allow_cpu: bool = False) -> str | None:
    """'gpu' or 'tpu' when JAX sees one (`allow_cpu`: 'cpu' too, to check the code path)."""
    import jax
    platform = jax.devices()[0].platform
    return platform if platform in ("gpu", "tpu") or allow_cpu else None


def measure(configs, seconds: float, rounds: int, allow_cpu=False):
    """The JSON-ready result, or None when there is no accelerator."""
    from tpu_keras.cluster import engine
    engine.select("jax")  # before Keras is imported
    platform = accelerator_platform(allow_cpu)
    if platform is None:
        return None
    import jax
    import tpu_keras
    from tpu_keras.measurement import peak

    cluster = tpu_keras.connect({"strategy": "auto"}, engine="jax")
    kind = jax.devices()[0].device_kind
    per_device = peak.published_bf16_peak(kind)
    results = []
    for name in configs:
        try:
            results.append(_measure(name, cluster, seconds, rounds, per_device * len(jax.devices())))
        except Exception as error:  # noqa: BLE001 - one config's failure leaves the others' figures
            results.append({"config": name, "error": timing.first_reason(error)})
    return {"benchmark": "accelerator", "platform": platform, "device_kind": kind,
            "devices": len(jax.devices()), "date": datetime.date.today().isoformat(),
            "published_bf16_peak_flops_per_device": per_device or None,
            "synthetic_batches": True, "tensorflow_imported": "tensorflow" in sys.modules,
            "results": results}


def _measure(name, cluster, seconds, rounds, peak_flops):
    """One config: the toolkit and plain Keras on JAX, in turns; examples/s and MFU."""
    import keras
    from tpu_keras.measurement import flops
    from tpu_keras.training import auto_values
    from tpu_keras.training.setup import build_model

    config = timing.config_by_name(name)
    config.engine = "jax"
    config.train.precision = "mixed_bfloat16"
    config.train.update(auto_values.resolve(config, cluster))  # the platform's steps per call
    keras.config.set_dtype_policy(config.train.precision)
    try:
        toolkit = build_model(config, cluster)
        plain = _plain_keras(config, cluster, toolkit)
        models = {"toolkit": toolkit, "keras": plain}
        per_example = flops.training_flops_per_example(toolkit)
        batch = BATCH_PER_DEVICE.get(name, 0) * cluster.num_replicas or config.train.batch_size
        rates, batch = _race(models, config, batch, seconds, rounds, cluster.num_replicas)
    finally:
        keras.config.set_dtype_policy("float32")
    result = {"config": name, "parameters": toolkit.count_params(),
              "precision": config.train.precision, "global_batch": batch,
              "steps_per_execution": config.train.steps_per_execution,
              "flops_per_example": per_example}
    for variant, turns in rates.items():
        if isinstance(turns, str):
            result[variant] = {"error": turns}
            continue
        rate = statistics.median(turns)
        result[variant] = {"examples_per_second": round(rate, 1),
                           "each_round": [round(r, 1) for r in turns],
                           "model_flops_per_second": float(f"{rate * per_example:.4g}"),
                           "mfu": round(rate * per_example / peak_flops, 4) if peak_flops else None}
    if all(not isinstance(rate, str) for rate in rates.values()):
        result["toolkit_over_keras"] = round(statistics.median(rates["toolkit"])
                                             / statistics.median(rates["keras"]), 3)
    del models, toolkit, plain
    gc.collect()
    return result


def _plain_keras(config, cluster, toolkit):
    """Plain Keras on JAX as its user would compile it: same model, optimizer, steps per call, XLA,
    under Keras's own data parallelism (none on one device), from the toolkit's initial weights."""
    import keras
    from tpu_keras import models
    from tpu_keras.training import optimization

    builder, kwargs = models.registry.get(config.model)
    keras.distribution.set_distribution(
        keras.distribution.DataParallel() if len(keras.distribution.list_devices()) > 1 else None)
    model = builder.make(**kwargs)
    model.compile(optimizer=optimization.make_optimizer(config.train), loss=builder.loss(),
                  weighted_metrics=builder.metrics(),
                  steps_per_execution=config.train.steps_per_execution, jit_compile=True)
    model.set_weights(toolkit.get_weights())
    return model


def _race(models, config, batch, seconds, rounds, replicas):
    """`timing.race` of the models, at the largest batch from `batch` down (halved while the
    devices run out of memory) that the toolkit's model fits. Returns (rates, batch)."""
    while True:
        data = _synthetic_batches(config, batch)
        try:
            timing.training_rate(models["toolkit"], data, batch, seconds / 4)  # compiles, finds the batch
            break
        except Exception as error:  # noqa: BLE001 - XLA's out-of-memory error has no public type
            if "RESOURCE_EXHAUSTED" not in str(error) or batch // 2 < replicas:
                raise
            batch //= 2
    return timing.race(timing.training_turns(models, data, batch, seconds), rounds), batch


def _synthetic_batches(config, batch):
    """An endless generator of one (tokens, next tokens) batch of random token ids, from numpy."""
    import numpy as np
    model = config.model
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, (batch, model.context_length + 1),
                                               dtype=np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def forever():
        while True:
            yield x, y
    return forever()


def no_accelerator_line() -> str:
    """What --accelerator prints, and all it does, on a machine without GPU or TPU."""
    import jax
    return (f"no accelerator here: JAX sees only {jax.devices()[0].platform} devices; run "
            "`python scripts/benchmark.py --accelerator` on a GPU or TPU machine")

