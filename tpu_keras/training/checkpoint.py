"""Save and restore everything a run needs to continue exactly where it stopped.

A checkpoint holds the model's variables (its weights and its random-number
state: dropout's seed generators) and the optimizer's (whose `iterations`
is the step). The input position is not saved: the pipeline is a pure
function of the step (see `data.pipeline`), so a resumed run rebuilds it
from the step.

Variables are stored by name (`models.weight_paths`: a weight by its
`variable.path`), in two groups, `model_by_path` and `optimizer_by_path`, and
restored by name: a model whose layers create same-shaped weights in another
order (query and key, gate and up) gets each value back under its own name.
Before restoring, the names and shapes are compared, and the first weight
missing on either side, or shaped differently, is a one-line `UserError`.
Checkpoints written before names were stored (their groups are `model`,
`optimizer` and `rng` on tf, lists `model` and `optimizer` on jax) still
restore, with a warning, by position as they were saved: they hold no names
to pair by, so same-shaped weights created in another order since would swap.

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

# Imported inside functions: JAX and Orbax (optional: absent on a plain install; the tf
# engine runs without JAX).
import os
import re

from absl import logging
import keras
import tensorflow as tf

from tpu_keras import workdir as workdir_lib
from tpu_keras.errors import UserError, first_line
from tpu_keras.models import weight_paths

# The groups of a checkpoint, each {key: variable} (`weight_paths`); their names also tell
# these checkpoints from those stored by position before.
MODEL, OPTIMIZER = "model_by_path", "optimizer_by_path"
_POSITIONAL_NOTE = ("checkpoint %s stores its variables by position (written before checkpoints "
                    "named them): restoring it by position")

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


def keyed_variables(model: keras.Model) -> dict:
    """{MODEL: {key: variable}, OPTIMIZER: {key: variable}}: what a checkpoint holds."""
    return {MODEL: weight_paths.model_variables(model),
            OPTIMIZER: weight_paths.optimizer_variables(model.optimizer)}


def check_fits(saved: dict, variables: dict, where: str) -> None:
    """Raises a one-line `UserError` naming the first variable that `saved` ({group: {key:
    shape}}) lacks, holds beyond `variables` (`keyed_variables`), or shapes otherwise."""
    shapes = {group: {key: v.shape for key, v in keyed.items()} for group, keyed in variables.items()}

    def random(key):
        return key.startswith(weight_paths.RANDOM_STATE)
    for group, noun, chosen in ((MODEL, "weight", lambda key: not random(key)),
                                (MODEL, "random-number state", random),
                                (OPTIMIZER, "optimizer variable", lambda key: True)):
        detail = weight_paths.mismatch(
            {k: v for k, v in saved.get(group, {}).items() if chosen(k)},
            {k: v for k, v in shapes[group].items() if chosen(k)}, noun)
        if detail:
            raise UserError(f"{where} does not fit this model: {detail}; build the model it was "
                            "saved from, or use a new --workdir for a different model")


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
        self._variables = keyed_variables(model)
        self._checkpoint = tf.train.Checkpoint(**self._variables)
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
            # The reader of this prefix itself: load_checkpoint asks gfile whether the prefix is a
            # folder, which ram:// answers yes to (its files start with it), then finds none there.
            reader = tf.compat.v1.train.NewCheckpointReader(path)
            saved = _tf_shapes(reader.get_variable_to_shape_map())
            if MODEL in saved:
                check_fits(saved, self._variables, f"the checkpoint {path}")
                checkpoint = self._checkpoint
            else:
                logging.warning(_POSITIONAL_NOTE, path)
                checkpoint = tf.train.Checkpoint(model=self._model, optimizer=self._model.optimizer,
                                                 rng=list(self._model.non_trainable_variables))
                checkpoint.save_counter
            checkpoint.restore(path).assert_existing_objects_matched()
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
        workdir_lib.write_whole(os.path.join(self.shared_dir, "checkpoint"), "".join(
            [f'model_checkpoint_path: "{names[-1]}"\n']
            + [f'all_model_checkpoint_paths: "{name}"\n' for name in names]))
        for old in previous[:len(previous) - len(kept)]:
            for file in tf.io.gfile.glob(f"{old}.*"):
                tf.io.gfile.remove(file)
        logging.info("saved checkpoint %s", path)


_TF_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"


def _tf_shapes(shapes: dict) -> dict:
    """{group: {key: shape}} of a TensorFlow checkpoint's {name: shape}, for the groups stored
    by name. TensorFlow names a variable by the path of objects that leads to it (here: the
    group, then the dict's key), with '.' escaped as '..' and '/' as '.S' within each name."""
    keyed = {}
    for name, shape in shapes.items():
        group, _, rest = name.partition("/")
        if group in (MODEL, OPTIMIZER) and rest.endswith(_TF_VALUE):
            key = re.sub(r"\.([.S])", lambda m: "/" if m.group(1) == "S" else ".",
                         rest[:-len(_TF_VALUE)])
            keyed.setdefault(group, {})[key] = shape
    return keyed


class OrbaxCheckpointer:
    """Saves the model's and the optimizer's variables, sharded as they are, with Orbax."""

    def __init__(self, workdir: str, model: keras.Model, keep: int = 3):
        import orbax.checkpoint as ocp
        self._ocp, self._model = ocp, model
        self.shared_dir = workdir_lib.absolute(os.path.join(workdir, "checkpoints"))
        # The handler named, so that a new process reads a checkpoint's metadata (its names).
        self._manager = ocp.CheckpointManager(self.shared_dir, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False),
            item_handlers=ocp.StandardCheckpointHandler())

    @property
    def step(self) -> int:
        return int(keras.ops.convert_to_numpy(self._model.optimizer.iterations))

    def latest_saved_step(self):
        """The step of the newest committed checkpoint, or None."""
        return self._manager.latest_step()

    def _variables(self):
        return keyed_variables(self._model)

    def saved_steps(self) -> list[int]:
        """The steps of the committed checkpoints, oldest first (read afresh: another
        process may be saving them)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def restore(self, step: int) -> None:
        """Restores the checkpoint of `step`, resharded onto this model's layout (which may
        differ from the one it was saved from); raises `Unreadable` if it is gone."""
        import jax
        try:
            saved = self._manager.item_metadata(step)
        except (FileNotFoundError, OSError) as error:
            raise Unreadable(f"checkpoint {step} in {self.shared_dir} is unreadable "
                             f"({first_line(error)})") from None
        saved = getattr(saved, "tree", saved)  # Orbax 0.11 on: a TreeMetadata
        where = f"the checkpoint at step {step} in {self.shared_dir}"
        if isinstance(saved, dict) and saved.get("model") is not None and MODEL not in saved:
            logging.warning(_POSITIONAL_NOTE, f"{step} in {self.shared_dir}")
            variables = {"model": self._model.variables, "optimizer": self._model.optimizer.variables}
        else:
            variables = self._variables()
            if isinstance(saved, dict) and MODEL in saved:
                check_fits({group: {key: meta.shape for key, meta in keyed.items()}
                            for group, keyed in saved.items()}, variables, where)
        target = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.value.sharding),
                              variables, is_leaf=lambda v: isinstance(v, keras.Variable))
        try:
            values = self._manager.restore(step, args=self._ocp.args.StandardRestore(target))
        except (FileNotFoundError, OSError) as error:
            raise Unreadable(f"checkpoint {step} in {self.shared_dir} is unreadable "
                             f"({first_line(error)})") from None
        except (ValueError, KeyError, TypeError) as error:
            raise UserError(f"{where} does not fit this model ({first_line(error)}); use a new "
                            "--workdir for a different model") from None
        for group, group_values in values.items():
            keyed = variables[group]
            pairs = (zip(keyed, group_values) if isinstance(keyed, list)  # by position
                     else ((keyed[key], value) for key, value in group_values.items()))
            for variable, value in pairs:
                variable.assign(value)

    def restore_latest(self) -> int:
        latest = self._manager.latest_step()
        if latest is not None:
            self.restore(latest)
            logging.info("resumed from %s at step %d", self.shared_dir, self.step)
        return self.step

    def save(self) -> None:
        state = {group: {key: v.value for key, v in keyed.items()}
                 for group, keyed in self._variables().items()}
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
