"""Save and restore the model, the optimizer and the step; resume where a run stopped.

On the tf engine this uses `tf.train.CheckpointManager`, which writes
distributed variables correctly under every strategy. Every host must call
`save` (TensorFlow requires it under MultiWorkerMirroredStrategy); only the
chief writes to the shared `DIR/checkpoints`, the others to a private folder
that is removed. On the jax engine it uses Orbax, which writes sharded arrays
from every process into the one shared folder (`open_checkpointer` picks).
"""

import os
import shutil

from absl import logging
import keras
import tensorflow as tf

from tpu_keras.errors import UserError


def open_checkpointer(workdir: str, model: keras.Model, cluster, keep: int = 3):
    """The checkpointer for the engine Keras runs on (both have step/restore_latest/save)."""
    if keras.backend.backend() == "jax":
        return OrbaxCheckpointer(workdir, model, keep)
    return TFCheckpointer(workdir, model, cluster, keep)


class TFCheckpointer:
    def __init__(self, workdir: str, model: keras.Model, cluster, keep: int = 3):
        self.shared_dir = os.path.join(workdir, "checkpoints")
        self._own_dir = (self.shared_dir if cluster.is_chief
                         else os.path.join(workdir, "tmp", f"host{cluster.host_index}"))
        self._model = model
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        self._manager = tf.train.CheckpointManager(self._checkpoint, self._own_dir, max_to_keep=keep)

    @property
    def step(self) -> int:
        return int(self._model.optimizer.iterations.numpy())

    def restore_latest(self) -> int:
        """Restores the newest checkpoint in the shared folder, if any; returns the step."""
        latest = tf.train.latest_checkpoint(self.shared_dir)
        if latest:
            try:
                self._checkpoint.restore(latest).assert_existing_objects_matched()
            except (AssertionError, ValueError, tf.errors.OpError) as error:
                reason = str(error).strip().splitlines()[0][:200]
                raise UserError(f"the checkpoint {latest} does not fit this model ({reason}); "
                                "use a new --workdir for a different model") from None
            logging.info("resumed from %s at step %d", latest, self.step)
        return self.step

    def save(self) -> None:
        path = self._manager.save(checkpoint_number=self.step)
        if self._own_dir != self.shared_dir:
            shutil.rmtree(self._own_dir, ignore_errors=True)
        else:
            logging.info("saved checkpoint %s", path)


class OrbaxCheckpointer:
    """Saves the model's and the optimizer's variables, sharded as they are, with Orbax."""

    def __init__(self, workdir: str, model: keras.Model, keep: int = 3):
        import orbax.checkpoint as ocp
        self._ocp, self._model = ocp, model
        self.shared_dir = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self._manager = ocp.CheckpointManager(self.shared_dir, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False))

    @property
    def step(self) -> int:
        return int(keras.ops.convert_to_numpy(self._model.optimizer.iterations))

    def _variables(self):
        return {"model": self._model.variables, "optimizer": self._model.optimizer.variables}

    def restore_latest(self) -> int:
        import jax
        latest = self._manager.latest_step()
        if latest is not None:
            variables = self._variables()
            target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.value.sharding),
                                  variables, is_leaf=lambda v: isinstance(v, keras.Variable))
            try:
                values = self._manager.restore(latest, args=self._ocp.args.StandardRestore(target))
            except (ValueError, KeyError, TypeError) as error:
                reason = str(error).strip().splitlines()[0][:200]
                raise UserError(f"the checkpoint at step {latest} in {self.shared_dir} does not fit "
                                f"this model ({reason}); use a new --workdir for a different model") from None
            for group, group_values in values.items():
                for variable, value in zip(variables[group], group_values):
                    variable.assign(value)
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
