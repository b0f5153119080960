"""A TensorBoard profile of chosen training steps: `log.profile_steps = (first, last)`.

The trace covers the executions that hold steps `first` to `last` (1-based,
inclusive, counted over the whole run as the log line counts them): a host
call runs `train.steps_per_execution` steps at once, so the profile is
rounded out to whole calls. It is written where TensorBoard's profile
plugin finds it, under `DIR/tensorboard/plugins/profile/`, by
`tf.profiler.experimental` on the tf engine and `jax.profiler` on jax; every
host writes its own trace there.
"""

# Imported inside functions: JAX (optional: absent on a plain install; the tf engine runs
# without JAX); TensorFlow (start-up time: not every caller needs it).
from absl import logging
import keras


class ProfileSteps(keras.callbacks.Callback):
    """Starts the engine's profiler before the first execution that runs a step of
    `first`..`last`, and stops it after the last such call."""

    def __init__(self, checkpointer, first: int, last: int, logdir: str):
        super().__init__()
        self._checkpointer, self._first, self._last = checkpointer, first, last
        self._logdir, self._active = logdir, False
        self._epoch_start = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self._checkpointer.step  # in sync between epochs on jax too

    def on_train_batch_begin(self, batch, logs=None):
        done = self._epoch_start + batch  # steps before this execution
        if not self._active and done < self._last and done + self.model.steps_per_execution >= self._first:
            _start(self._logdir)
            self._active = True
            logging.info("profiling from step %d into %s", done + 1, self._logdir)

    def on_train_batch_end(self, batch, logs=None):
        if self._active and self._epoch_start + batch + 1 >= self._last:
            self._stop(logs, self._epoch_start + batch + 1)

    def on_train_end(self, logs=None):
        if self._active:  # the run stopped inside the range
            self._stop(logs, self._checkpointer.step)

    def _stop(self, logs, step):
        if logs and "loss" in logs:  # jax dispatches asynchronously: wait for the steps
            keras.ops.convert_to_numpy(logs["loss"])
        _stop()
        self._active = False
        logging.info("profiled up to step %d: open it with `tensorboard --logdir %s`, Profile tab",
                     step, self._logdir)


def _start(logdir: str) -> None:
    if keras.backend.backend() == "jax":
        import jax
        jax.profiler.start_trace(logdir)
    else:
        import tensorflow as tf
        tf.profiler.experimental.start(logdir)


def _stop() -> None:
    if keras.backend.backend() == "jax":
        import jax
        jax.profiler.stop_trace()
    else:
        import tensorflow as tf
        tf.profiler.experimental.stop()
