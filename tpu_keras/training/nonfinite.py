"""The NaN/Inf guard: a non-finite loss or gradient stops the run before anything bad is saved.

The train step (`tf_steps`, `jax_steps`) applies no update whose loss or global
gradient norm is NaN or Inf: the weights, the optimizer state and its step
count stay as they were. Both are checked because either can stay finite
while the other is not (a fused CPU kernel can turn a NaN input into a zero
activation, so the loss is finite while the gradient is NaN). On the tf
engine the host loop also ends the execution at that step, so
`StopOnNonFinite` names it exactly; on the jax engine, whose host loop is
Keras's own, the step count falling behind the steps run shows which host
call held it. Nothing is saved after the divergence, so the last checkpoint
is the last good one. `train.on_nonfinite` says what happens next:

* `stop`: the run ends with an error that names the step;
* `restore_and_skip`: the run reloads the last good checkpoint and trains on
  with the batches that diverged left out (their positions are kept in
  `DIR/checkpoints/skipped_batches.json`, so a resumed run leaves them out
  too), at most `train.max_nonfinite_skips` times.

Before the final checkpoint and the export, the weights themselves are
checked once: a run never ends with exit 0 and non-finite weights.

Loss scaling (float16, user code only: a run's `train.precision` has no
float16) is Keras's: under a `keras.optimizers.LossScaleOptimizer` an overflow
of the scaled gradients skips the update and halves the scale, on both
engines, in the toolkit's step (`tf_steps` hands the overflow to the
optimizer and does not end the execution for it; `jax_steps` keeps the
optimizer's new scale in the step it skips).
"""

# Imported inside functions: TensorFlow (start-up time: not every caller needs it).
import json
import math
import os

import keras

from tpu_keras import workdir
from tpu_keras.errors import UserError

GRAD_NORM = "grad_norm"  # the log key of the global gradient norm, which the guard watches
SKIPPED_FILE = "skipped_batches.json"
_WATCHED = (("loss", "loss"), (GRAD_NORM, "gradient norm"))  # (log key, what it is)


class NonFiniteStep(Exception):
    """The loss or the gradient norm became NaN or Inf at one of steps `first`..`last`
    (1-based); no update of a non-finite step was applied."""

    def __init__(self, first: int, last: int, what: str):
        where = f"step {last}" if first == last else f"one of steps {first}-{last}"
        super().__init__(f"{what} at {where}")
        self.first, self.last = first, last


class StopOnNonFinite(keras.callbacks.Callback):
    """Raises `NonFiniteStep` after the execution that held a non-finite step, and
    `UserError` if the weights are not finite when the run ends."""

    def __init__(self, checkpointer, total_steps: int):
        super().__init__()
        self._checkpointer, self._total = checkpointer, total_steps
        self._epoch_start = self._last_good = 0

    def on_epoch_begin(self, epoch, logs=None):
        # Read here: on jax the variables are only in sync between epochs.
        self._epoch_start = self._last_good = self._checkpointer.step

    def on_train_batch_end(self, batch, logs=None):
        bad = [f"the {what} became {float(logs[key])}" for key, what in _WATCHED
               if key in (logs or {}) and not math.isfinite(float(logs[key]))]
        if keras.backend.backend() == "tensorflow":
            if bad:  # the host loop stopped at that step, whose update was not applied
                raise NonFiniteStep(self._checkpointer.step + 1, self._checkpointer.step + 1,
                                    bad[0])
            return
        ran = self._epoch_start + batch + 1
        self.model.jax_state_sync()  # Keras's jax loop keeps the step count apart until then
        if bad or self._checkpointer.step < ran:
            raise NonFiniteStep(self._last_good + 1, ran,
                                bad[0] if bad else "the gradient norm became non-finite")
        self._last_good = ran

    def on_epoch_end(self, epoch, logs=None):
        step = self._checkpointer.step
        if step >= self._total and not weights_are_finite(self.model):
            raise UserError(
                f"the weights are not finite at step {step}, although every step's loss and "
                "gradient norm were; nothing was saved after the last checkpoint in "
                f"{self._checkpointer.shared_dir}; check the model's layers and the optimizer")


def weights_are_finite(model) -> bool:
    """Whether every weight is free of NaN and Inf (sharded jax arrays are checked where they live)."""
    return all(bool(keras.ops.convert_to_numpy(keras.ops.all(keras.ops.isfinite(w.value))))
               for w in model.weights)


def load_skipped(checkpoint_dir: str) -> list[int]:
    """Batch positions that earlier attempts of this run left out."""
    import tensorflow as tf  # here: the jax step imports this module, and needs no TensorFlow
    path = os.path.join(checkpoint_dir, SKIPPED_FILE)
    if not tf.io.gfile.exists(path):
        return []
    with tf.io.gfile.GFile(path) as f:
        return json.load(f)


def save_skipped(checkpoint_dir: str, positions: list[int]) -> None:
    """Writes the positions with a rename, so a reader never sees half a file."""
    import tensorflow as tf
    tf.io.gfile.makedirs(checkpoint_dir)
    workdir.write_whole(os.path.join(checkpoint_dir, SKIPPED_FILE), json.dumps(sorted(positions)))
