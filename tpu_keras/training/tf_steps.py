"""The tf engine's train/test functions for `model.fit`, which work under every tf.distribute strategy.

Keras 3's TensorFlow trainer breaks in three places once there is more than
one replica:

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
host loop in cross-replica context - up to `steps_per_execution` steps that
stop when the iterator runs dry - and average each scalar over replicas
with `strategy.reduce(..., axis=None)`. With `jit_compile`, XLA compiles
each replica's forward and backward pass (on one replica, the whole step),
so every strategy gets both XLA and many steps per call. The same step
(`make_guarded_train_step`) logs the global gradient norm and applies no update
whose gradient or loss is not finite; under a `LossScaleOptimizer` (float16)
it scales the loss and leaves an overflow to the optimizer, as Keras's own
step does. A loss that is a mean over weights is
one token mean over every replica and micro-batch (`token_mean`), in the
step and in the evaluation's `test_step`.
"""

import types

import keras
import tensorflow as tf

from tpu_keras.models import chunked_loss
from tpu_keras.training import token_mean
from tpu_keras.training.nonfinite import GRAD_NORM

# The Keras trainer hooks replaced: no public API lets a model bring its own
# host loop to `fit` (docs/design.md).
_HOOKS = ("make_train_function", "make_test_function", "_maybe_symbolic_build", "test_step")


def distributed_steps(model: keras.Model, grad_accum_steps: int = 1) -> keras.Model:
    """Gives `model` step functions that work under any strategy; returns it.

    Call it once, on a model built inside `strategy.scope()`, before `fit`.
    Compiling again keeps them. Each update averages `grad_accum_steps`
    micro-batches of the batch it is given.
    """
    for hook in _HOOKS:
        setattr(model, hook, types.MethodType(globals()[hook], model))
    model._tpu_keras_grad_accum_steps = grad_accum_steps
    return model


def make_train_function(self, force=False):
    if self.train_function is None or force:
        # On one replica XLA compiles the whole step, optimizer included; with
        # more, only each replica's forward and backward pass (see make_guarded_train_step).
        whole = self.jit_compile and self.distribute_strategy.num_replicas_in_sync == 1
        step = make_guarded_train_step(self, jit_forward_backward=self.jit_compile and not whole,
                                       grad_accum_steps=self._tpu_keras_grad_accum_steps)
        first_outputs = lambda: {**self.get_metrics_result(), GRAD_NORM: tf.constant(0.0)}
        # Under loss scaling an overflow of the gradients is the optimizer's signal, not a
        # divergence: the execution goes on, and a non-finite loss alone ends it.
        watched = ("loss",) if _scales_loss(self.optimizer) else ("loss", GRAD_NORM)
        self.train_function = _host_loop(self, step, first_outputs, jit_whole_step=whole,
                                         stop_on_nonfinite=watched)
    return self.train_function


def make_test_function(self, force=False):
    if self.test_function is None or force:
        xla = self.jit_compile and self.distribute_strategy.num_replicas_in_sync == 1
        self.test_function = _host_loop(self, self.test_step, self.get_metrics_result,
                                        jit_whole_step=xla)
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


def test_step(self, data):
    """Keras's test step, its loss tracker counting each batch as `token_mean` says (by its
    weights' sum, for a weighted mean), so `val_loss` is the mean over every token."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with chunked_loss.targets(y):  # a chunked head's per-token loss in place of the logits
        y_pred = self(x, training=False) if self._call_has_training_arg else self(x)
    loss = self._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
    replicas = tf.distribute.get_replica_context().num_replicas_in_sync  # compute_loss divided by them
    self._loss_tracker.update_state(loss * replicas,
                                    sample_weight=token_mean.tracker_weight(self, x, sample_weight))
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _host_loop(model, step_fn, first_outputs, jit_whole_step=False, stop_on_nonfinite=()):
    """Runs up to `steps_per_execution` steps per call to the host.

    `first_outputs()` gives tensors shaped as `step_fn`'s outputs, to start
    the loop from: the step then has one call site, so it is traced once (for
    a large model, most of the host loop's tracing time). `jit_whole_step`
    compiles `step_fn` with XLA as a whole, which works on one replica only
    (keras-team/keras#19005). A step whose output named in `stop_on_nonfinite`
    (the loss, the gradient norm) is NaN or Inf ends the call, so the host
    sees the step that diverged (see `nonfinite`).
    """
    strategy = model.distribute_strategy
    if jit_whole_step and not model.run_eagerly:
        step_fn = tf.function(step_fn, jit_compile=True, reduce_retracing=True)

    def one_step(batch):
        outputs = strategy.run(step_fn, args=(batch,))
        return tf.nest.map_structure(lambda v: _mean_over_replicas(strategy, v), outputs)

    def finite(outputs):
        return tf.reduce_all([tf.math.is_finite(outputs[key]) for key in stop_on_nonfinite
                              if key in outputs])

    def steps(iterator):
        outputs, ran = first_outputs(), 0
        for _ in tf.range(model.steps_per_execution):
            if stop_on_nonfinite and not finite(outputs):
                break
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                break
            outputs = one_step(batch.get_value())
            ran += 1
        if ran == 0:
            next(iterator)  # no data left: raises the OutOfRangeError that ends Keras's epoch
        return outputs

    return steps if model.run_eagerly else tf.function(steps, reduce_retracing=True)


def make_guarded_train_step(model, jit_forward_backward=False, grad_accum_steps=1):
    """The train step under every strategy: XLA on each replica, and no update from a
    non-finite gradient.

    With `jit_forward_backward`, XLA compiles the forward and backward pass
    (on one replica the caller compiles the whole step instead). XLA cannot
    wrap `strategy.run` (keras-team/keras#19005), nor Keras's whole
    `train_step` on a replica: a compiled function that captures variables is
    traced once and reused by every replica, and the optimizer all-reduces
    through `merge_call`. So XLA compiles a pure function - variable values
    in; loss, gradients, predictions and updated state out - as Keras's JAX
    trainer does. Then the step sums the gradients over replicas itself, so
    that every replica sees the global gradient: its norm is logged as
    `grad_norm`, and when it or the loss is not finite the optimizer is not
    applied at all (the weights, the optimizer state and its step count stay
    as they were). A loss alone can miss a divergence: a fused
    `relu(matmul(x, w) + b)` on CPU turns a NaN row of `x` into zeros, so the
    loss stays finite while the gradient of `w` is NaN.

    With `grad_accum_steps` k above 1, each replica's batch holds k
    micro-batches (rows i, i + k, ...: the split the jax engine makes); their
    gradients are summed, each scaled by its share of the step (`token_mean`:
    its weights over every replica's, for a mean over weights; else 1 / k),
    before the one update.

    Under a `keras.optimizers.LossScaleOptimizer` (float16; `compile` wraps
    the optimizer in one under `mixed_float16`) the gradients are those of
    the scaled loss, as in Keras's own step, and the jax engine's: the
    optimizer's scale is read once per step and handed to the compiled pass
    as a value. The norm logged is the unscaled gradients' (Inf in a step
    that overflowed). The optimizer itself unscales them and, when they
    overflowed, halves its scale and makes no update; the guard adds its own
    skip of a step whose loss is not finite, in which the scale stays.
    """
    scaling = _scales_loss(model.optimizer)

    def loss_and_gradients(trainable, non_trainable, metrics, x, y, sample_weight, loss_scale):
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            with chunked_loss.targets(y):  # a chunked head's per-token loss in place of the logits
                y_pred, non_trainable, losses = model.stateless_call(
                    trainable, non_trainable, x, return_losses=True,
                    **({"training": True} if model._call_has_training_arg else {}))
            model._losses_override = losses  # regularisation losses, for compute_loss
            loss, (_, non_trainable, metrics) = model.stateless_compute_loss(
                trainable, non_trainable, metrics, x=x, y=y, y_pred=y_pred,
                sample_weight=sample_weight, training=True)
            model._losses_override = []
            scaled_loss = loss if loss_scale is None else loss * tf.cast(loss_scale, loss.dtype)
        # Dense, as on jax: an embedding's gradient comes as IndexedSlices with a row per
        # occurrence of a token, whose global norm is not the gradient's, and which
        # Keras's TensorFlow Adam applies as a sparse ("lazy") update.
        gradients = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in tape.gradient(scaled_loss, trainable)]
        return loss, gradients, y_pred, non_trainable, metrics

    if jit_forward_backward and not model.run_eagerly:
        loss_and_gradients = tf.function(loss_and_gradients, jit_compile=True, reduce_retracing=True)

    @tf.autograph.experimental.do_not_convert  # Keras's code needs no conversion; it costs seconds
    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        values = lambda variables: [v.value for v in variables]
        trainable, non_trainable = values(model.trainable_variables), values(model.non_trainable_variables)
        metrics = values(model.metrics_variables)
        k = grad_accum_steps
        batch = (x, y, sample_weight)
        parts = [batch] if k == 1 else [_micro_batch(batch, i, k) for i in range(k)]
        replica = tf.distribute.get_replica_context()
        replicas = replica.num_replicas_in_sync
        # A token mean divides by the step's weights, every replica's (one scalar all-reduce).
        step_weight = (replica.all_reduce("SUM", token_mean.weight_sum(sample_weight))
                       if token_mean.applies(model, sample_weight) else None)
        # The scale as a value (one read of the optimizer's variable), not a captured variable.
        loss_scale = tf.cast(model.optimizer.scale_loss(1.0), tf.float32) if scaling else None
        losses, gradients, y_preds = [], None, []
        for part in parts:  # traced one after another
            loss, part_gradients, y_pred, non_trainable, metrics = loss_and_gradients(
                trainable, non_trainable, metrics, *part, loss_scale)
            share = token_mean.share(model, part[2], step_weight, k, replicas)
            loss = loss * share
            part_gradients = [None if g is None else g * tf.cast(share, g.dtype) for g in part_gradients]
            losses.append(loss)
            y_preds.append(y_pred)
            gradients = part_gradients if gradients is None else [
                None if a is None else a + b for a, b in zip(gradients, part_gradients)]
        if k > 1:
            loss = tf.add_n(losses)
            # Metrics see the whole batch, micro-batch after micro-batch.
            x, y, sample_weight, y_pred = (_concat(pieces) for pieces in
                                           zip(*[part + (pred,) for part, pred in zip(parts, y_preds)]))
        for variable, value in zip(model.non_trainable_variables + model.metrics_variables,
                                   non_trainable + metrics):
            variable.assign(value)
        pairs = [(g, v) for g, v in zip(gradients, model.trainable_variables) if g is not None]
        # Each replica's loss is its term of the global mean (compute_loss divided it by the
        # replicas; a token mean, by the step's weights), so the sums are global means.
        global_loss, gradients = replica.all_reduce("SUM", (loss, [g for g, _ in pairs]))
        grad_norm = tf.cast(tf.linalg.global_norm(gradients), tf.float32)
        finite = tf.math.is_finite(grad_norm) & tf.math.is_finite(global_loss)
        if scaling:
            grad_norm = grad_norm / loss_scale
            # An overflow goes to the optimizer too: it halves its scale and updates nothing.
            update = finite | tf.logical_not(model.optimizer.check_finite(gradients))
        else:
            update = finite
        _apply_if_finite(model.optimizer, gradients, [v for _, v in pairs], update)
        if step_weight is None:
            model._loss_tracker.update_state(loss * replicas, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        else:  # this replica's own token mean, counted by its weights
            own = token_mean.weight_sum(sample_weight)
            model._loss_tracker.update_state(tf.math.divide_no_nan(loss * step_weight, own),
                                             sample_weight=own)
        return {**model.compute_metrics(x, y, y_pred, sample_weight=sample_weight),
                GRAD_NORM: grad_norm}

    return train_step


def _micro_batch(batch, i: int, k: int):
    """Micro-batch `i` of `k`: rows i, i + k, ... of every tensor (None stays None)."""
    return tuple(None if t is None else tf.nest.map_structure(lambda a: a[i::k], t) for t in batch)


def _concat(pieces):
    """The micro-batches' tensors (or None) back into one batch, one after another."""
    if pieces[0] is None:
        return None
    return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *pieces)


def _scales_loss(optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def _apply_if_finite(optimizer, gradients, variables, finite):
    """`optimizer.apply(gradients, variables)` when `finite` (the same on every replica);
    otherwise nothing changes, not even the optimizer's step count.

    The gradients are already summed over replicas. Keras 3's TensorFlow
    optimizer would sum them again inside `apply`, and unlike Keras 2
    (`skip_gradients_aggregation=True`) it has no switch to say they are, so
    its one summing hook is bypassed while the update is traced (a
    `LossScaleOptimizer`'s inner optimizer's: that one applies them). The branch
    runs in cross-replica context, as Keras's LossScaleOptimizer does it: a
    `tf.cond` in replica context cannot hold the `merge_call` that applying
    gradients makes.
    """
    def apply(gradients):
        optimizer.apply(gradients, variables)

    applier = optimizer.inner_optimizer if _scales_loss(optimizer) else optimizer

    def cross_replica(strategy, gradients, finite):
        applier._all_reduce_sum_gradients = lambda grads_and_vars: grads_and_vars
        try:
            tf.cond(strategy.experimental_local_results(finite)[0],
                    lambda: strategy.extended.call_for_each_replica(apply, args=(gradients,)),
                    lambda: None)
        finally:
            del applier._all_reduce_sum_gradients

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(gradients, finite))


def _mean_over_replicas(strategy, value):
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.reduce("MEAN", value, axis=None)
    return value
