"""The jax engine's train step: Keras's own, plus the gradient norm and no update from a
non-finite gradient.

Keras's JAX trainer already runs one jitted SPMD step under the global
`keras.distribution`, so its host loop stays; only `train_step` changes. The
gradients are global arrays here, so their norm is the global one with no
collective of ours. When the norm or the loss is not finite, the new
weights and optimizer state are dropped for the old ones (`jnp.where`, as
optax's `apply_if_finite` does): the step count does not advance either,
which is how the host sees, after an execution of several steps, that one of
them was skipped (see `nonfinite`).

With a `keras.optimizers.LossScaleOptimizer` (float16; `compile` wraps the
optimizer in one under `mixed_float16`) the gradients are those of the
scaled loss, and an overflow among them is the optimizer's signal to halve
its scale and skip the update, as in plain Keras. So the guard keeps its
weights and its inner optimizer's state on a non-finite step as always, but
takes the loss-scaling optimizer's own variables (the scale and its growth
count) from the step: were they kept too, the scale would never fall, and
every step would overflow again and make no update. The norm logged is the
unscaled gradients' (Inf in a step that overflowed).

With `grad_accum_steps` k above 1 the batch holds k micro-batches; a
`lax.scan` runs them one after another (so only one micro-batch's
activations and predictions are alive at a time; the metrics take each
micro-batch in turn) and the update applies the sum of their gradients, each
scaled by its share of the step (`token_mean`: its weights over the batch's,
for a mean over weights, so the step's loss is one token mean; else 1 / k):
one step, one update, whatever k is. The loss tracker counts each batch by
its weights for such a loss (`_update_metrics_variables`, the train and the
test step's), so the logged loss and `val_loss` are means over every token.

A mixture of experts' forward pass records its experts' load (`moe.recorded_load`),
which the step returns beside `grad_norm` for the log line: the busiest expert's share
(the largest over the micro-batches) and the copies a capacity dropped (their mean).

`distributed_steps` also hands the jitted steps committed arrays. Under a
`keras.distribution` on a one-device mesh (a laptop, one TPU chip or GPU),
Keras leaves the weights it creates, and the metrics it resets each epoch,
uncommitted (the put that would commit them moves nothing, so it is
skipped), while the step's outputs come back committed; `jax.jit` keys on
that, so without it the train step traces and compiles again on its second
call and after every validation, and the test step twice (plain Keras with
no distribution compiles once). Meshes of two or more devices commit every
array already.
"""

import types

import jax
import jax.numpy as jnp
import keras

from tpu_keras.models import chunked_loss, moe
from tpu_keras.training import token_mean
from tpu_keras.training.nonfinite import GRAD_NORM


def distributed_steps(model: keras.Model, grad_accum_steps: int = 1) -> keras.Model:
    """Gives `model` the guarded train step (`grad_accum_steps` micro-batches per update)
    and a loss tracker that counts tokens; returns it."""
    def train_step(self, state, data):
        return guarded_train_step(self, state, data, grad_accum_steps)
    keras_test_step = model.test_step

    def test_step(self, state, data):  # a chunked head's per-token loss in place of the logits
        with chunked_loss.targets(keras.utils.unpack_x_y_sample_weight(data)[1]):
            return keras_test_step(state, data)
    model.train_step = types.MethodType(train_step, model)
    model.test_step = types.MethodType(test_step, model)
    model._update_metrics_variables = types.MethodType(_update_metrics_variables, model)
    _hand_steps_committed_state(model)
    return model


def _update_metrics_variables(self, metrics_variables, unscaled_loss, x, y, y_pred, sample_weight):
    """Keras's JAX trainer's own (its train and test steps call it), the loss tracker
    counting the batch as `token_mean.tracker_weight` says, not by its rows."""
    with keras.StatelessScope(state_mapping=list(zip(self.metrics_variables, metrics_variables))) as scope:
        self._loss_tracker.update_state(
            unscaled_loss, sample_weight=token_mean.tracker_weight(self, x, sample_weight))
        logs = self.compute_metrics(x, y, y_pred, sample_weight)
    updated = [scope.get_current_value(v) for v in self.metrics_variables]
    return logs, [v.value if new is None else new for v, new in zip(self.metrics_variables, updated)]


def _hand_steps_committed_state(model: keras.Model) -> None:
    """Commits every state array as Keras gathers it for a jitted step, so the step's inputs
    match its outputs from the first call on and it compiles once (module docstring)."""
    gather = getattr(model, "_get_jax_state", None)  # Keras's one gathering point; no public hook
    if gather is None:
        return

    def committed(array):
        if isinstance(array, jax.Array) and not array.committed:
            return jax.device_put(array, array.sharding)  # no copy: the same buffer, committed
        return array

    model._get_jax_state = lambda *args, **kwargs: jax.tree.map(committed, gather(*args, **kwargs))


def guarded_train_step(self, state, data, grad_accum_steps=1):
    trainable, non_trainable, optimizer_state, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if grad_accum_steps == 1:
        (_, ((unscaled_loss, y_pred, non_trainable, metrics), load)), gradients = jax.value_and_grad(
            _with_load(self.compute_loss_and_updates), has_aux=True)(
            trainable, non_trainable, metrics, x, y, sample_weight, training=True,
            optimizer_variables=optimizer_state)
        logs, metrics = self._update_metrics_variables(
            metrics, unscaled_loss, x, y, y_pred, sample_weight)
    else:
        micro_batches = tuple(split_micro_batches(t, grad_accum_steps) for t in (x, y, sample_weight))
        step_weight = (token_mean.weight_sum(sample_weight)
                       if token_mean.applies(self, sample_weight) else None)

        def micro_step(carry, batch):
            gradient_sum, loss_sum, non_trainable, metrics = carry
            share = token_mean.share(self, batch[2], step_weight, grad_accum_steps)

            def shared_loss(*args, **kwargs):  # this micro-batch's term of the step's loss
                loss, aux = _with_load(self.compute_loss_and_updates)(*args, **kwargs)
                return loss * share, aux
            (_, ((loss, y_pred, non_trainable, _), load)), gradients = jax.value_and_grad(
                shared_loss, has_aux=True)(
                trainable, non_trainable, metrics, *batch, training=True,
                optimizer_variables=optimizer_state)
            # Metrics see every micro-batch in turn, so no micro-batch's predictions outlive
            # it (a language model's logits, stacked, were k times the largest activation).
            _, metrics = self._update_metrics_variables(metrics, loss, *batch[:2], y_pred, batch[2])
            return (jax.tree.map(jnp.add, gradient_sum, gradients), loss_sum + loss * share,
                    non_trainable, metrics), load

        zeros = jax.tree.map(jnp.zeros_like, trainable)
        (gradients, unscaled_loss, non_trainable, metrics), loads = jax.lax.scan(
            micro_step, (zeros, jnp.zeros((), "float32"), non_trainable, metrics), micro_batches)
        load = {key: (jnp.max if key == moe.BUSIEST else jnp.mean)(value) for key, value in loads.items()}
        logs = _results(self, metrics)
    grad_norm = global_norm(gradients)
    scaling = isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)
    if scaling:  # float16: the gradients of the scaled loss; the norm logged is the unscaled one
        grad_norm = grad_norm / loss_scale(self.optimizer, optimizer_state)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(unscaled_loss)
    new_trainable, new_optimizer_state = self.optimizer.stateless_apply(
        optimizer_state, gradients, trainable)

    def keep(new, old):  # the step's new value where it is finite, else the old one
        return jnp.where(finite, new, old)

    trainable = jax.tree.map(keep, new_trainable, trainable)
    if scaling:
        # The loss-scaling optimizer's own variables (its scale and growth count) take their
        # new values even in a skipped step: an overflow is how its scale comes down.
        own = own_variables(self.optimizer)
        optimizer_state = [new if id(variable) in own else keep(new, old) for variable, new, old
                           in zip(self.optimizer.variables, new_optimizer_state, optimizer_state)]
    else:
        optimizer_state = jax.tree.map(keep, new_optimizer_state, optimizer_state)
    return {**logs, **load, GRAD_NORM: grad_norm}, (trainable, non_trainable, optimizer_state, metrics)


def _with_load(loss_and_updates):
    """`compute_loss_and_updates` with the experts' load of its forward pass beside its aux
    (`moe.recorded_load`; {} for a dense model), so the step logs it; its forward pass knows
    its labels (`chunked_loss.targets`: a chunked head gives each token's loss)."""
    def call(trainable, non_trainable, metrics, x, y, *args, **kwargs):
        with moe.recorded_load() as load, chunked_loss.targets(y):
            loss, aux = loss_and_updates(trainable, non_trainable, metrics, x, y, *args, **kwargs)
        return loss, (aux, load.logs())
    return call


def _results(model, metrics) -> dict:
    """The metrics' results read from their state `metrics`, as `compute_metrics` returns them."""
    with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, metrics))):
        return model.get_metrics_result()


def loss_scale(optimizer, optimizer_state) -> jax.Array:
    """A `keras.optimizers.LossScaleOptimizer`'s current scale, read from the step's state."""
    with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, optimizer_state))):
        return jnp.asarray(optimizer.scale_loss(1.0), "float32")


def own_variables(optimizer) -> set[int]:
    """The ids of a `LossScaleOptimizer`'s own variables, not its inner optimizer's."""
    inner = {id(v) for v in optimizer.inner_optimizer.variables}
    return {id(v) for v in optimizer.variables if id(v) not in inner}


def global_norm(arrays) -> jax.Array:
    """The L2 norm of all `arrays` together, summed in float32."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(a.astype(jnp.float32))) for a in jax.tree.leaves(arrays)))


def split_micro_batches(tree, k: int):
    """(k * b, ...) arrays -> (k, b, ...): micro-batch i holds rows i, i + k, i + 2k, ...

    Interleaved, so that each device's rows of the sharded batch hold an equal
    share of every micro-batch and the micro-steps stay evenly split.
    """
    def split(a):
        return jnp.swapaxes(a.reshape((a.shape[0] // k, k) + a.shape[1:]), 0, 1)
    return jax.tree.map(split, tree)
