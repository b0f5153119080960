"""Save and restore everything a run needs to continue exactly where it stopped.

A checkpoint holds the model's variables (its weights and its random-number
state: dropout's seed generators) and the optimizer's (whose `iterations`
is the step). The input position is not saved: the pipeline is a pure
function of the step (see `data.pipeline`), so a resumed run rebuilds it
from the step.

A LoRA run over a preset holds less (`models.frozen_base`): its trainable
variables (the factors), its random-number state and the optimizer's: its
frozen base is read from `model.preset` again at every start. A checkpoint of
such a run that holds the base too (written before its checkpoints held
adapters alone) still restores: the tf engine leaves its base unread, Orbax
restores it whole.

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

Saves are asynchronous by default (`checkpoint.asynchronous`): `save` blocks
the training loop only while the state is copied from the devices to host
memory; the write and the commit happen on a background thread
(`background.Writer`) while training goes on. At most one save is in flight:
a save that finds the previous one still writing waits for it, and that wait
is timed. Everything that reads the saved steps (a restore, `saved_steps`)
first waits for the save in flight, and the run waits for its last save
before it exits (`wait`): a save is committed, or reported lost in one line.
"""

# Imported inside functions: JAX and Orbax (optional: absent on a plain install; the tf
# engine runs without JAX).
import os
import re
import threading

from absl import logging
import keras
import tensorflow as tf

from tpu_keras import workdir as workdir_lib
from tpu_keras.errors import UserError, first_line
from tpu_keras.models import weight_paths
from tpu_keras.training import background

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


def keyed_variables(model: keras.Model, adapters_only: bool = False) -> dict:
    """{MODEL: {key: variable}, OPTIMIZER: {key: variable}}: what a checkpoint holds; with
    `adapters_only`, of the model's only the trainable and the random-number state."""
    keyed = weight_paths.model_variables(model)
    if adapters_only:
        keyed = {key: v for key, v in keyed.items()
                 if v.trainable or key.startswith(weight_paths.RANDOM_STATE)}
    return {MODEL: keyed, OPTIMIZER: weight_paths.optimizer_variables(model.optimizer)}


def frozen_keys(model: keras.Model, adapters_only: bool) -> set:
    """The keys of the model's weights that its adapters-only checkpoints leave out (none
    for one that holds everything): what an older checkpoint of the run holds beyond them."""
    if not adapters_only:
        return set()
    return set(keyed_variables(model)[MODEL]) - set(keyed_variables(model, adapters_only)[MODEL])


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


def open_checkpointer(workdir: str, model: keras.Model, cluster, keep: int = 3,
                      asynchronous: bool = False, adapters_only: bool = False):
    """The checkpointer for the engine Keras runs on (both have step, save, wait,
    restore, restore_latest, saved_steps and latest_saved_step); `adapters_only`: its
    checkpoints hold what trains alone (`keyed_variables`)."""
    if keras.backend.backend() == "jax":
        return OrbaxCheckpointer(workdir, model, keep, asynchronous, adapters_only)
    return TFCheckpointer(workdir, model, cluster, keep, asynchronous, adapters_only)


class TFCheckpointer:
    """Saves the model's and the optimizer's variables with `tf.train.Checkpoint`.

    Asynchronous saves copy every variable, in the loop, into a host copy: CPU
    variables of the same names, made once, and outside the distribution
    strategy's scope (on a thread of their own: a strategy's scope is per
    thread), so they are plain local values that only the chief needs to write.
    The writer thread then writes and commits them. The copy costs host memory
    for one more copy of the state.
    """

    def __init__(self, workdir: str, model: keras.Model, cluster, keep: int = 3,
                 asynchronous: bool = False, adapters_only: bool = False):
        self.shared_dir = os.path.join(workdir, "checkpoints")
        self._is_chief = cluster.is_chief
        self._own_dir = (self.shared_dir if cluster.is_chief
                         else os.path.join(workdir, "tmp", f"host{cluster.host_index}"))
        self._model, self._keep, self._adapters_only = model, keep, adapters_only
        self._variables = keyed_variables(model, adapters_only)
        self._checkpoint = tf.train.Checkpoint(**self._variables)
        self._checkpoint.save_counter  # created now, so every checkpoint holds it and restores match
        self.writer = background.Writer() if asynchronous else None
        self._host_copy = None  # the writer thread's CPU variables, made by its first save

    @property
    def step(self) -> int:
        return int(self._model.optimizer.iterations.numpy())

    def wait(self) -> None:
        """Returns once the save in flight (if any) is committed; raises `background.SaveLost`."""
        if self.writer:
            self.writer.wait()

    def latest_saved_step(self):
        """The step of the newest committed checkpoint, or None."""
        self.wait()
        committed = self.committed()
        return int(committed[-1].rsplit("-", 1)[-1]) if committed else None

    def committed(self) -> list[str]:
        """The committed checkpoints' path prefixes, oldest first."""
        state = tf.train.get_checkpoint_state(self.shared_dir)
        return list(state.all_model_checkpoint_paths) if state else []

    def saved_steps(self) -> list[int]:
        """The steps of the committed checkpoints, oldest first."""
        self.wait()
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
                # The frozen base of a checkpoint written before this run's held its adapters
                # alone: left unread (TensorFlow restores what the checkpoint object names).
                frozen = frozen_keys(self._model, self._adapters_only)
                saved[MODEL] = {key: shape for key, shape in saved[MODEL].items() if key not in frozen}
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
        self.wait()
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
        """Saves the current step: written and committed before it returns, or, with
        asynchronous saves, copied to host memory and written on the writer thread."""
        step = self.step
        if not self.writer:
            path = self._checkpoint.write(os.path.join(self._own_dir, f"ckpt-{step}"))
            if self._is_chief:
                self._commit(path)
            elif tf.io.gfile.exists(self._own_dir):  # every host writes; only the chief's is kept
                tf.io.gfile.rmtree(self._own_dir)
            return
        self.writer.make_room(step)
        if not self._is_chief:
            return
        if self._host_copy is None:  # the first save: the copy is made with its values
            self._host_copy = _outside_any_strategy(lambda: _host_variables(self._variables))
            self._host_checkpoint = tf.train.Checkpoint(**self._host_copy)
            self._host_checkpoint.save_counter
        else:
            for group, keyed in self._variables.items():
                for key, variable in keyed.items():
                    self._host_copy[group][key].assign(_copied(variable))  # device to host
        path = os.path.join(self.shared_dir, f"ckpt-{step}")
        self.writer.start(step, lambda: self._commit(self._host_checkpoint.write(path)))

    def _commit(self, path: str) -> None:
        """Makes the written checkpoint `path` the latest, and removes the ones beyond `keep`."""
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


def _copied(variable):
    """The variable's value in a host buffer of its own. A read of a CPU variable shares its
    buffer, and an XLA step then updates that buffer in place: the copy would change with
    the next step (seen: a checkpoint written with a later step's values)."""
    with tf.device("/cpu:0"):
        return tf.raw_ops.DeepCopy(x=variable.value)


def _host_variables(variables: dict) -> dict:
    """{group: {key: a CPU tf.Variable holding a copy of the variable's value}} of
    `keyed_variables`."""
    with tf.device("/cpu:0"):
        return {group: {key: tf.Variable(_copied(v), trainable=False)
                        for key, v in keyed.items()} for group, keyed in variables.items()}


def _outside_any_strategy(make):
    """`make()`, run on a thread of its own: outside the distribution strategy's scope, which
    `fit` holds in this one, so the variables it creates are not mirrored."""
    made = []
    thread = threading.Thread(target=lambda: made.append(make()), name="host-copy")
    thread.start()
    thread.join()
    if not made:
        raise RuntimeError("could not make the checkpoint's host copy (see the log)")
    return made[0]


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

    def __init__(self, workdir: str, model: keras.Model, keep: int = 3, asynchronous: bool = False,
                 adapters_only: bool = False):
        import orbax.checkpoint as ocp
        self._ocp, self._model, self._adapters_only = ocp, model, adapters_only
        self.shared_dir = workdir_lib.absolute(os.path.join(workdir, "checkpoints"))
        # The handler named, so that a new process reads a checkpoint's metadata (its names).
        # Asynchronous: Orbax's save returns once the arrays are in host memory, and its
        # own thread writes and commits them; the writer thread here waits for that.
        self._manager = ocp.CheckpointManager(self.shared_dir, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=asynchronous),
            item_handlers=ocp.StandardCheckpointHandler())
        self.writer = background.Writer() if asynchronous else None

    @property
    def step(self) -> int:
        return int(keras.ops.convert_to_numpy(self._model.optimizer.iterations))

    def wait(self) -> None:
        """Returns once the save in flight (if any) is committed; raises `background.SaveLost`."""
        if self.writer:
            self.writer.wait()

    def latest_saved_step(self):
        """The step of the newest committed checkpoint, or None."""
        self.wait()
        return self._manager.latest_step()

    def _variables(self):
        return keyed_variables(self._model, self._adapters_only)

    def saved_steps(self) -> list[int]:
        """The steps of the committed checkpoints, oldest first (read afresh: another
        process may be saving them)."""
        self.wait()
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
                # A checkpoint holding the frozen base too, written before this run's held its
                # adapters alone: restored whole (Orbax restores a whole tree).
                if frozen_keys(self._model, self._adapters_only) & set(saved[MODEL]):
                    variables = keyed_variables(self._model)
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
        self.wait()
        latest = self._manager.latest_step()
        if latest is not None:
            self.restore(latest)
            logging.info("resumed from %s at step %d", self.shared_dir, self.step)
        return self.step

    def save(self) -> None:
        state = {group: {key: v.value for key, v in keyed.items()}
                 for group, keyed in self._variables().items()}
        step = self.step
        if self.writer:
            self.writer.make_room(step)
        self._manager.save(step, args=self._ocp.args.StandardSave(state), force=True)
        if self.writer:
            self.writer.start(step, lambda: self._committed(step))
        else:
            self._committed(step)

    def _committed(self, step: int) -> None:
        self._manager.wait_until_finished()  # raises what a background write raised
        logging.info("saved checkpoint %s/%d", self.shared_dir, step)


class SaveEvery(keras.callbacks.Callback):
    """Saves at every `every_steps` boundary of a run whose epochs are log intervals."""

    def __init__(self, checkpointer, every_steps: int, total_steps: int):
        super().__init__()
        self._checkpointer, self._every, self._total = checkpointer, every_steps, total_steps

    def on_epoch_end(self, epoch, logs=None):
        step = self._checkpointer.step
        if step % self._every == 0 or step >= self._total:
            self._checkpointer.save()
