"""What the toolkit hooks into `fit`: one log line and TensorBoard scalars per log
interval, and the timing of executions for the run's time breakdown.

`fit` runs with one Keras "epoch" per log interval, so epoch boundaries are
where the step, the loss, the last validation and the throughput are known.
"""

import time

from absl import logging
import keras
import tensorflow as tf


class IntervalLogger(keras.callbacks.Callback):
    """Logs step, metrics, learning rate, throughput and MFU at the end of every interval.

    Throughput is timed from the end of the interval's first execution to the
    end of its last, so tracing, XLA compilation and validation never count
    as training time.
    """

    def __init__(self, *, total_steps: int, global_batch: int,
                 tokens_per_example: float = 0, flops_per_example: float = 0, peak_flops: float = 0.0,
                 writer=None):
        super().__init__()
        self._total = total_steps
        self._batch, self._tokens = global_batch, tokens_per_example
        self._flops, self._peak = flops_per_example, peak_flops
        self._writer = writer  # the run's TensorBoard writer (training.controller), or None
        self._clock = None  # (time, steps done) at the end of the first execution
        self._last = None   # (time, steps done) at the end of the latest execution

    def on_epoch_begin(self, epoch, logs=None):
        self._clock = self._last = None

    def on_train_batch_end(self, batch, logs=None):
        self._last = (time.perf_counter(), batch + 1)
        if self._clock is None:
            self._clock = self._last

    def on_epoch_end(self, epoch, logs=None):
        # From the optimizer, not the epoch: a resumed run may start mid-interval.
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        scalars = {k: float(v) for k, v in (logs or {}).items() if _is_number(v)}
        # The schedule's rate for the next update, as other trainers log it.
        scalars["learning_rate"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        (start, start_steps), (end, end_steps) = self._clock, self._last
        if end_steps > start_steps:
            scalars["examples_per_second"] = (end_steps - start_steps) * self._batch / (end - start)
            if self._tokens:
                scalars["tokens_per_second"] = scalars["examples_per_second"] * self._tokens
            if self._flops:
                scalars["model_flops_per_second"] = scalars["examples_per_second"] * self._flops
                if self._peak:
                    # Model FLOPs utilization: the share of the peak the model's matmuls use.
                    scalars["mfu"] = scalars["model_flops_per_second"] / self._peak
        log_scalars(step, self._total, scalars, self._writer)


class FitTimer(keras.callbacks.Callback):
    """Times executions (the first of each fit apart), validations and fit's return
    into a `timings.RunTimings`. Put it first: its batch end then times the call alone."""

    def __init__(self, timings, compile_counter=None):
        super().__init__()
        self._timings, self._cache = timings, compile_counter  # a compile_cache.CompileCounter
        self._first = True
        self._call_start = self._test_start = self._train_end = None

    def on_train_begin(self, logs=None):
        self._first = True

    def on_train_batch_begin(self, batch, logs=None):
        if self._first and self._cache:
            self._cache.begin()
        self._call_start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # No sync of our own: Keras hands callbacks that are not `async_safe` (none of the
        # run's are) logs it has already turned into Python numbers, so the call is done.
        calls = self._timings.first_host_calls if self._first else self._timings.host_calls
        calls.append(time.perf_counter() - self._call_start)
        if self._first and self._cache:
            self._cache.end()
        self._first = False

    def on_test_begin(self, logs=None):
        self._test_start = time.perf_counter()

    def on_test_end(self, logs=None):
        self._timings.seconds["validation"] += time.perf_counter() - self._test_start

    def on_train_end(self, logs=None):
        self._train_end = time.perf_counter()

    def fit_returned(self):
        """Call right after `fit` returns or raises: the time it took after its last callback."""
        if self._train_end is not None:
            self._timings.seconds["fit_teardown"] += time.perf_counter() - self._train_end
            self._train_end = None


def log_scalars(step: int, total: int, scalars: dict, writer=None) -> None:
    """One log line of `scalars` at `step` of `total`, and the same scalars to TensorBoard
    through `writer` (a summary file writer, or None)."""
    logging.info("step %d/%d | %s", step, total,
                 " | ".join(f"{k} {format_number(v)}" for k, v in scalars.items()))
    if writer:
        with writer.as_default(step=step):
            for name, value in scalars.items():
                tf.summary.scalar(name, value)
        writer.flush()


def _is_number(value):
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def format_number(value):
    if abs(value) >= 1e7:
        return f"{value:.3g}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
