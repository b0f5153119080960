"""Benchmarks, printed as JSON. Quote ratios: absolute numbers drift on a shared machine.

    python scripts/benchmark.py --data

--data: for each shipped config, the examples/s its training input pipeline
produces on one device, next to the examples/s its training step consumes
(measured on data cached in memory, so the step alone is timed). The ratio
says how far the pipeline is from being the bottleneck.
"""

import json
import os
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "configs"))

_DATA = flags.DEFINE_bool("data", False, "Input pipeline rate vs training consumption.")
_CONFIGS = flags.DEFINE_list("configs", ["lm_stdlib", "digits"], "Config modules under configs/.")
_SECONDS = flags.DEFINE_float("seconds", 10.0, "Time spent measuring each rate.")


def _rate(run_once, examples_per_call, seconds):
    """Calls `run_once` (after two warm-up calls) for about `seconds`; returns examples/s."""
    run_once()
    run_once()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run_once()
        calls += 1
    return calls * examples_per_call / (time.perf_counter() - start)


def data_benchmark(name, seconds):
    """One config's pipeline rate and training rate on one device, in examples/s."""
    import importlib
    import tensorflow as tf
    import tpu_keras
    from tpu_keras import data, models, train

    config = importlib.import_module(name).get_config()
    cluster = tpu_keras.connect({"strategy": "one_device"})
    batch = config.train.batch_size
    dataset, _ = data.build(config.data, cluster, batch, training=True)
    batches = iter(dataset)
    pipeline = _rate(lambda: next(batches), batch, seconds)

    # The step alone: one real batch, repeated from memory.
    cached = tf.data.Dataset.from_tensors(next(batches)).repeat()
    builder, _ = models.registry.get(config.model)
    model = models.build(config.model, cluster.strategy)
    train.compile_model(model, builder, config.train, cluster.strategy)
    steps = config.train.steps_per_execution
    fit = lambda calls: model.fit(cached, epochs=1, steps_per_epoch=calls * steps, verbose=0)
    start = time.perf_counter()
    fit(2)  # compiles
    calls = 2
    while time.perf_counter() - start < seconds / 4:  # find a length worth timing
        fit(calls)
        calls *= 2
    start = time.perf_counter()
    fit(calls)
    training = calls * steps * batch / (time.perf_counter() - start)
    return {"config": name, "global_batch": batch, "steps_per_execution": steps,
            "pipeline_examples_per_second": round(pipeline, 1),
            "training_examples_per_second": round(training, 1),
            "pipeline_over_training": round(pipeline / training, 2)}


def main(argv):
    del argv
    if not _DATA.value:
        raise app.UsageError("choose a benchmark: --data")
    results = [data_benchmark(name, _SECONDS.value) for name in _CONFIGS.value]
    print(json.dumps({"benchmark": "data", "results": results}, indent=2))


if __name__ == "__main__":
    app.run(main)
