"""Save and restore everything a run needs to continue exactly where it stopped.

A checkpoint holds the model, the optimizer (whose `iterations` is the
step) and the model's non-trainable variables, named apart because they
hold its random-number state (dropout's seed generators), which
TensorFlow's object graph does not reach by itself. The input position is
not saved: the pipeline is a pure function of the step (see
`data.pipeline`), so a resumed run rebuilds it from the step.

Saves are atomic. On the tf engine every host writes the checkpoint files
(TensorFlow requires all of them to take part under MultiWorkerMirrored-
Strategy; the chief into the shared `DIR/checkpoints`, the others into a
private folder that is then removed), and only then does the chief commit
it by rewriting the `checkpoint` state file in one atomic step. A run killed
while writing leaves files that nothing points to, and the previous
checkpoint stays the latest (tensorflow/tensorflow#61552 is a checkpoint
made unusable by a preemption mid-save). A committed checkpoint that still
cannot be read (a truncated file on a storage that is not atomic) is skipped
with a warning in favour of the one before it. On the jax engine Orbax does
the same: it writes into a temporary folder and renames it when complete.
"""

import os

from absl import logging
import keras
import tensorflow as tf

from tpu_keras import workdir as workdir_lib
from tpu_keras.errors import UserError, first_line

# Reading errors that mean "this checkpoint is damaged", as opposed to "it is
# a checkpoint of another model".
_UNREADABLE = (tf.errors.DataLossError, tf.errors.NotFoundError, tf.errors.OutOfRangeError,
               IndexError)


class Unreadable(Exception):
    """A checkpoint that is gone (deleted by `checkpoint.keep` meanwhile) or damaged."""


def any_saved(workdir: str) -> bool:
    """Whether the run in `workdir` has committed a checkpoint, known before its model is
    built (TensorFlow's state file, or an Orbax step folder)."""
    folder = os.path.join(workdir, "checkpoints")
    try:
        names = tf.io.gfile.listdir(folder)
    except tf.errors.NotFoundError:
        return False
    return any(name.rstrip("/") == "checkpoint" or name.rstrip("/").isdigit() for name in names)


def open_checkpointer(workdir: str, model: keras.Model, cluster, keep: int = 3):
    """The checkpointer for the engine Keras runs on (both have step/restore_latest/save)."""
    if keras.backend.backend() == "jax":
        return OrbaxCheckpointer(workdir, model, keep)
    return TFCheckpointer(workdir, model, cluster, keep)


class TFCheckpointer:
    def __init__(self, workdir: str, model: keras.Model, cluster, keep: int = 3):
        self.shared_dir = os.path.join(workdir, "checkpoints")
        self._is_chief = cluster.is_chief
        self._own_dir = (self.shared_dir if cluster.is_chief
                         else os.path.join(workdir, "tmp", f"host{cluster.host_index}"))
        self._model, self._keep = model, keep
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                                               rng=list(model.non_trainable_variables))
        self._checkpoint.save_counter  # created now, so every checkpoint holds it and restores match

    @property
    def step(self) -> int:
        return int(self._model.optimizer.iterations.numpy())

    def latest_saved_step(self):
        """The step of the newest committed checkpoint, or None."""
        committed = self.committed()
        return int(committed[-1].rsplit("-", 1)[-1]) if committed else None

    def committed(self) -> list[str]:
        """The committed checkpoints' path prefixes, oldest first."""
        state = tf.train.get_checkpoint_state(self.shared_dir)
        return list(state.all_model_checkpoint_paths) if state else []

    def saved_steps(self) -> list[int]:
        """The steps of the committed checkpoints, oldest first."""
        return [int(path.rsplit("-", 1)[-1]) for path in self.committed()]

    def restore(self, step: int) -> None:
        """Restores the committed checkpoint of `step`; raises `Unreadable` if it is gone or damaged."""
        self._restore(os.path.join(self.shared_dir, f"ckpt-{step}"))

    def _restore(self, path: str) -> None:
        try:
            self._checkpoint.restore(path).assert_existing_objects_matched()
        except _UNREADABLE as error:
            raise Unreadable(f"checkpoint {path} is unreadable ({first_line(error)})") from None
        except (AssertionError, ValueError, tf.errors.OpError) as error:
            raise UserError(f"the checkpoint {path} does not fit this model ({first_line(error)}); "
                            "use a new --workdir for a different model") from None

    def restore_latest(self) -> int:
        """Restores the newest readable checkpoint in the shared folder, if any; returns the step."""
        candidates = self.committed()
        for path in reversed(candidates):
            try:
                self._restore(path)
            except Unreadable as error:
                logging.warning("%s; trying the one before it", error)
                continue
            logging.info("resumed from %s at step %d", path, self.step)
            return self.step
        if candidates:
            raise UserError(f"no checkpoint in {self.shared_dir} is readable; move the folder "
                            "away to start afresh")
        return self.step

    def save(self) -> None:
        """Writes the checkpoint of the current step (every host), then commits it (chief)."""
        step = self.step
        path = self._checkpoint.write(os.path.join(self._own_dir, f"ckpt-{step}"))
        if not self._is_chief:
            if tf.io.gfile.exists(self._own_dir):
                tf.io.gfile.rmtree(self._own_dir)
            return
        previous = [p for p in self.committed() if p != path]
        kept = previous[max(0, len(previous) - self._keep + 1):] if self._keep > 1 else []
        # The commit: one atomic rewrite of the state file `tf.train.get_checkpoint_state`
        # reads (a text proto), with names relative to the folder, as CheckpointManager
        # writes it, so the folder can be moved (to gs:// and back).
        names = [os.path.basename(p) for p in kept + [path]]
        workdir_lib.write_text(os.path.join(self.shared_dir, "checkpoint"), "".join(
            [f'model_checkpoint_path: "{names[-1]}"\n']
            + [f'all_model_checkpoint_paths: "{name}"\n' for name in names]))
        for old in previous[:len(previous) - len(kept)]:
            for file in tf.io.gfile.glob(f"{old}.*"):
                tf.io.gfile.remove(file)
        logging.info("saved checkpoint %s", path)


class OrbaxCheckpointer:
    """Saves the model's and the optimizer's variables, sharded as they are, with Orbax."""

    def __init__(self, workdir: str, model: keras.Model, keep: int = 3):
        import orbax.checkpoint as ocp
        self._ocp, self._model = ocp, model
        self.shared_dir = workdir_lib.absolute(os.path.join(workdir, "checkpoints"))
        self._manager = ocp.CheckpointManager(self.shared_dir, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False))

    @property
    def step(self) -> int:
        return int(keras.ops.convert_to_numpy(self._model.optimizer.iterations))

    def latest_saved_step(self):
        """The step of the newest committed checkpoint, or None."""
        return self._manager.latest_step()

    def _variables(self):
        return {"model": self._model.variables, "optimizer": self._model.optimizer.variables}

    def saved_steps(self) -> list[int]:
        """The steps of the committed checkpoints, oldest first (read afresh: another
        process may be saving them)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def restore(self, step: int) -> None:
        """Restores the checkpoint of `step`, resharded onto this model's layout (which may
        differ from the one it was saved from); raises `Unreadable` if it is gone."""
        import jax
        variables = self._variables()
        target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.value.sharding),
                              variables, is_leaf=lambda v: isinstance(v, keras.Variable))
        try:
            values = self._manager.restore(step, args=self._ocp.args.StandardRestore(target))
        except (FileNotFoundError, OSError) as error:
            raise Unreadable(f"checkpoint {step} in {self.shared_dir} is unreadable "
                             f"({first_line(error)})") from None
        except (ValueError, KeyError, TypeError) as error:
            raise UserError(f"the checkpoint at step {step} in {self.shared_dir} does not fit "
                            f"this model ({first_line(error)}); use a new --workdir for a "
                            "different model") from None
        for group, group_values in values.items():
            for variable, value in zip(variables[group], group_values):
                variable.assign(value)

    def restore_latest(self) -> int:
        latest = self._manager.latest_step()
        if latest is not None:
            self.restore(latest)
            logging.info("resumed from %s at step %d", self.shared_dir, self.step)
        return self.step

    def save(self) -> None:
        state = {group: [v.value for v in vs] for group, vs in self._variables().items()}
        self._manager.save(self.step, args=self._ocp.args.StandardSave(state), force=True)
        self._manager.wait_until_finished()
        logging.info("saved checkpoint %s/%d", self.shared_dir, self.step)


class SaveEvery(keras.callbacks.Callback):
    """Saves at every `every_steps` boundary of a run whose epochs are log intervals."""

    def __init__(self, checkpointer, every_steps: int, total_steps: int):
        super().__init__()
        self._checkpointer, self._every, self._total = checkpointer, every_steps, total_steps

    def on_epoch_end(self, epoch, logs=None):
        step = self._checkpointer.step
        if step % self._every == 0 or step >= self._total:
            self._checkpointer.save()
