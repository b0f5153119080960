"""Benchmarks, printed as JSON. Quote ratios: absolute numbers drift on a shared machine.

    python scripts/benchmark.py --data

--data: for each shipped config, the examples/s its training input pipeline
(one host's tf.data pipeline, pulled inside a tf.function as training pulls
it) produces, next to the examples/s its training step consumes on one
device (one batch repeated from memory, so the step alone is timed). The
ratio says how far the pipeline is from being the bottleneck. The rate
through the strategy's distributed iterator is shown too: that transport is
TensorFlow's, and training pays it as well.
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
    from tpu_keras import data, models, optimization

    config = importlib.import_module(name).get_config()
    cluster = tpu_keras.connect({"strategy": "one_device"})
    batch = config.train.batch_size
    host_pipeline, _ = data.pipeline.dataset_fn(config.data, cluster, batch, training=True)
    pipeline_batches = iter(host_pipeline(tf.distribute.InputContext()))
    distributed_batches = iter(data.build(config.data, cluster, batch, training=True)[0])

    @tf.function
    def drain(iterator, count=tf.constant(100)):
        """Pulls `count` batches inside TensorFlow, as a training loop does."""
        for _ in tf.range(count):
            next(iterator)

    pipeline = _rate(lambda: drain(pipeline_batches), 100 * batch, seconds)
    distributed = _rate(lambda: drain(distributed_batches), 100 * batch, seconds)

    # The step alone: one real batch, repeated from memory.
    cached = tf.data.Dataset.from_tensors(next(pipeline_batches)).repeat()
    builder, _ = models.registry.get(config.model)
    model = models.build(config.model, cluster)
    optimization.compile_model(model, builder, config.train, cluster)
    steps = config.train.steps_per_execution
    def fit(calls):
        start = time.perf_counter()
        model.fit(cached, epochs=1, steps_per_epoch=calls * steps, verbose=0)
        return time.perf_counter() - start

    fit(2)  # traces and compiles
    calls = max(2, round(2 * seconds / fit(2)))  # a run that lasts about `seconds`
    training = calls * steps * batch / fit(calls)
    return {"config": name, "global_batch": batch, "steps_per_execution": steps,
            "pipeline_examples_per_second": round(pipeline, 1),
            "through_strategy_examples_per_second": round(distributed, 1),
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
