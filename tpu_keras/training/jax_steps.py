"""The jax engine's train step: Keras's own, plus the gradient norm and no update from a
non-finite gradient.

Keras's JAX trainer already runs one jitted SPMD step under the global
`keras.distribution`, so its host loop stays; only `train_step` changes. The
gradients are global arrays here, so their norm is the global one with no
collective of ours. When the norm or the loss is not finite, the new
weights and optimizer state are dropped for the old ones (`jnp.where`, as
optax's `apply_if_finite` does): the step count does not advance either,
which is how the host sees, after a host call of several steps, that one of
them was skipped (see `nonfinite`).
"""

import types

import jax
import jax.numpy as jnp
import keras

from tpu_keras.training.nonfinite import GRAD_NORM


def install(model: keras.Model) -> keras.Model:
    """Gives `model` the guarded train step; returns it."""
    model.train_step = types.MethodType(guarded_train_step, model)
    return model


def guarded_train_step(self, state, data):
    trainable, non_trainable, optimizer_state, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    (loss, (unscaled_loss, y_pred, non_trainable, metrics)), gradients = jax.value_and_grad(
        self.compute_loss_and_updates, has_aux=True)(
        trainable, non_trainable, metrics, x, y, sample_weight, training=True,
        optimizer_variables=optimizer_state)
    grad_norm = global_norm(gradients)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(unscaled_loss)
    new_trainable, new_optimizer_state = self.optimizer.stateless_apply(
        optimizer_state, gradients, trainable)
    trainable, optimizer_state = jax.tree.map(
        lambda new, old: jnp.where(finite, new, old),
        (new_trainable, new_optimizer_state), (trainable, optimizer_state))
    logs, metrics = self._update_metrics_variables(
        metrics, unscaled_loss, x, y, y_pred, sample_weight)
    return {**logs, GRAD_NORM: grad_norm}, (trainable, non_trainable, optimizer_state, metrics)


def global_norm(arrays) -> jax.Array:
    """The L2 norm of all `arrays` together, summed in float32."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(a.astype(jnp.float32))) for a in jax.tree.leaves(arrays)))
