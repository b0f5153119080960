"""The NaN/Inf guard: a non-finite loss stops the run before anything bad is saved.

The host loop (`steps`) ends a host call at the first step whose loss is
not finite, so on the tf engine `StopOnNonFinite` names that exact step; on
the jax engine, whose loop is Keras's own, it names the host call's steps.
Nothing is saved after the divergence, so the last checkpoint is the last
good one. `train.on_nonfinite` says what happens next:

* `stop`: the run ends with an error that names the step;
* `restore_and_skip`: the run reloads the last good checkpoint and trains on
  with the batches that diverged left out (their positions are kept in
  `DIR/checkpoints/skipped_batches.json`, so a resumed run leaves them out
  too), at most `train.max_nonfinite_skips` times.
"""

import json
import math
import os

import keras
import tensorflow as tf

SKIPPED_FILE = "skipped_batches.json"


class NonFiniteLoss(Exception):
    """The loss became NaN or Inf at one of steps `first`..`last` (1-based)."""

    def __init__(self, first: int, last: int, value: float):
        where = f"step {last}" if first == last else f"steps {first}-{last}"
        super().__init__(f"the loss became {value} at {where}")
        self.first, self.last = first, last


class StopOnNonFinite(keras.callbacks.Callback):
    """Raises `NonFiniteLoss` after the host call whose loss is not finite."""

    def __init__(self, checkpointer):
        super().__init__()
        self._checkpointer = checkpointer
        self._epoch_start = self._last_good = 0

    def on_epoch_begin(self, epoch, logs=None):
        # Read here: on jax the variables are only in sync between epochs.
        self._epoch_start = self._last_good = self._checkpointer.step

    def on_train_batch_end(self, batch, logs=None):
        loss = float((logs or {}).get("loss", 0.0))
        if math.isfinite(loss):
            self._last_good = self._epoch_start + batch + 1
            return
        if keras.backend.backend() == "tensorflow":
            # The host loop stopped at the step that diverged.
            step = self._checkpointer.step
            raise NonFiniteLoss(step, step, loss)
        self.model.jax_state_sync()  # Keras's jax loop keeps the state apart until then
        raise NonFiniteLoss(self._last_good + 1, self._epoch_start + batch + 1, loss)


def load_skipped(checkpoint_dir: str) -> list[int]:
    """Batch positions that earlier attempts of this run left out."""
    path = os.path.join(checkpoint_dir, SKIPPED_FILE)
    if not tf.io.gfile.exists(path):
        return []
    with tf.io.gfile.GFile(path) as f:
        return json.load(f)


def save_skipped(checkpoint_dir: str, positions: list[int]) -> None:
    """Writes the positions with a rename, so a reader never sees half a file."""
    tf.io.gfile.makedirs(checkpoint_dir)
    path = os.path.join(checkpoint_dir, SKIPPED_FILE)
    with tf.io.gfile.GFile(path + ".tmp", "w") as f:
        json.dump(sorted(positions), f)
    tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
