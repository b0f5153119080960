"""Train/test functions for `model.fit` that work under every tf.distribute strategy.

Keras 3's TensorFlow trainer breaks in two places once there is more than one
replica (DESIGN.md facts 1 and 3):

* its `steps_per_execution` loop runs `strategy.run` inside a `tf.cond` on an
  `Optional`, which fails under a multi-device MirroredStrategy
  (keras-team/keras#19246);
* under MultiWorkerMirroredStrategy it reduces a PerReplica *input batch* to
  build the model, and reduces scalar metrics along axis 0
  (keras-team/keras#20585);
* with `jit_compile=True` it wraps `strategy.run` itself in XLA, which fails
  under a multi-device MirroredStrategy (keras-team/keras#19005).

`distributed_steps(model)` replaces the three trainer hooks involved with one
mechanism that holds for every strategy: build the model's metrics and
optimizer from one replica's batch before anything is traced, then run the
host loop in cross-replica context - one unconditional step, then
`steps_per_execution - 1` more that stop when the iterator runs dry - and
average each scalar over replicas with `strategy.reduce(..., axis=None)`.
With `jit_compile`, XLA compiles each replica's forward and backward pass
(`xla_train_step`), so every strategy gets both XLA and many steps per call.
"""

import types

import keras
import tensorflow as tf

_HOOKS = ("make_train_function", "make_test_function", "_maybe_symbolic_build")


def distributed_steps(model: keras.Model) -> keras.Model:
    """Gives `model` step functions that work under any strategy; returns it.

    Call it once, on a model built inside `strategy.scope()`, before `fit`.
    Compiling again keeps the fix. On the jax engine Keras's own trainer
    already runs under `keras.distribution`, and the model is returned as is.
    """
    if keras.backend.backend() != "tensorflow":
        return model
    for hook in _HOOKS:
        setattr(model, hook, types.MethodType(globals()[hook], model))
    return model


def make_train_function(self, force=False):
    if self.train_function is None or force:
        # A loss-scaling optimizer (float16) scales inside Keras's own step: keep it.
        scaled = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
        self.train_function = _host_loop(self, self.train_step, None if scaled else xla_train_step(self),
                                         stop_on_nonfinite=True)
    return self.train_function


def make_test_function(self, force=False):
    if self.test_function is None or force:
        self.test_function = _host_loop(self, self.test_step)
    return self.test_function


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    """Creates metric and optimizer variables before any step is traced.

    Variables created lazily inside the host loop's control flow are what
    breaks tracing under MirroredStrategy, so the build always happens here,
    from the first replica's share of the first batch.
    """
    strategy = self.distribute_strategy
    if iterator is not None:
        # Keras resets the epoch iterator right after this call; resetting before
        # matters too: fit's cached validation iterator may be spent, because a
        # distributed dataset reports per-replica batches as its cardinality.
        iterator.reset()
        for _, _, batches in iterator:
            data_batch = tf.nest.map_structure(
                lambda x: strategy.experimental_local_results(x)[0], next(batches))
            break
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def _host_loop(model, step_fn, xla_step=None, stop_on_nonfinite=False):
    """Runs up to `steps_per_execution` steps per call to the host.

    With `jit_compile`, `xla_step` (when given) replaces `step_fn`: it keeps
    the XLA part inside each replica, which works under every strategy.
    With `stop_on_nonfinite`, a step whose loss is NaN or Inf ends the call,
    so the host sees the step that diverged (see `nonfinite`).
    """
    strategy = model.distribute_strategy
    if model.jit_compile and not model.run_eagerly:
        if xla_step is not None:
            step_fn = xla_step
        elif strategy.num_replicas_in_sync == 1:
            step_fn = tf.function(step_fn, jit_compile=True, reduce_retracing=True)

    def one_step(batch):
        outputs = strategy.run(step_fn, args=(batch,))
        return tf.nest.map_structure(lambda v: _mean_over_replicas(strategy, v), outputs)

    def steps(iterator):
        outputs = one_step(next(iterator))
        for _ in tf.range(model.steps_per_execution - 1):
            if stop_on_nonfinite and "loss" in outputs and not tf.math.is_finite(outputs["loss"]):
                break
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                break
            outputs = one_step(batch.get_value())
        return outputs

    return steps if model.run_eagerly else tf.function(steps, reduce_retracing=True)


def xla_train_step(model):
    """A train step whose forward and backward pass XLA compiles on each replica.

    XLA cannot wrap `strategy.run` (keras-team/keras#19005), nor Keras's whole
    `train_step` on a replica: a compiled function that captures variables is
    traced once and reused by every replica, and the optimizer all-reduces
    through `merge_call`. So XLA compiles a pure function - variable values
    in; loss, gradients, predictions and updated state out - and the
    optimizer applies the gradients outside it, where the strategy can
    all-reduce them. It is Keras's JAX trainer, in TensorFlow.
    """
    @tf.function(jit_compile=True, reduce_retracing=True)
    def loss_and_gradients(trainable, non_trainable, metrics, x, y, sample_weight):
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            y_pred, non_trainable, losses = model.stateless_call(
                trainable, non_trainable, x, return_losses=True,
                **({"training": True} if model._call_has_training_arg else {}))
            model._losses_override = losses  # regularisation losses, for compute_loss
            loss, (_, non_trainable, metrics) = model.stateless_compute_loss(
                trainable, non_trainable, metrics, x=x, y=y, y_pred=y_pred,
                sample_weight=sample_weight, training=True)
            model._losses_override = []
        return loss, tape.gradient(loss, trainable), y_pred, non_trainable, metrics

    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        values = lambda variables: [v.value for v in variables]
        loss, gradients, y_pred, non_trainable, metrics = loss_and_gradients(
            values(model.trainable_variables), values(model.non_trainable_variables),
            values(model.metrics_variables), x, y, sample_weight)
        for variable, value in zip(model.non_trainable_variables + model.metrics_variables,
                                   non_trainable + metrics):
            variable.assign(value)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        model._loss_tracker.update_state(  # compute_loss divided it by the replicas
            loss * replicas, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        model.optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return train_step


def _mean_over_replicas(strategy, value):
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.reduce("MEAN", value, axis=None)
    return value
