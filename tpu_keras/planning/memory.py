"""Activation memory of a training step: what autodiff keeps for the backward pass.

With rematerialisation off, every intermediate the backward pass needs (the
"residuals" of the forward pass) is alive at once at the step's peak. Their
total is the activation estimate: JAX traces the model's loss on abstract
values and lists the residuals it would save, so the estimate is exact about
shapes and dtypes (bf16 activations under mixed precision, attention's
seq x seq scores) and allocates nothing. Weights that autodiff also keeps are
left out: they are already counted as parameters.

The check is XLA's own buffer assignment for the compiled sharded step
(`tpu_keras.planning.compiled_step`, `python -m tpu_keras.plan --measure`): the
part of its temporary memory that grows with the batch.
"""

import jax

from tpu_keras.planning import model_split as model_split_lib
from tpu_keras.planning.jaxpr_walk import is_literal, nbytes


def abstract_inputs(model, batch: int):
    """Shapes of one batch: the model's input, and integer labels for a sparse loss."""
    inputs, outputs = model.inputs[0], model.outputs[0]
    x = jax.ShapeDtypeStruct((batch, *inputs.shape[1:]), inputs.dtype)
    y = jax.ShapeDtypeStruct((batch, *outputs.shape[1:-1]), "int32")
    return x, y


def loss_function(model, loss):
    """loss(weights, state, x, y): the model's training loss as a pure function of its weights."""
    def loss_of(weights, state, x, y):
        logits, _ = model.stateless_call(weights, state, x, training=True)
        return loss(y, logits)
    return loss_of


def abstract(variables):
    """Shapes and dtypes of `variables`, for tracing without their values."""
    return [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in variables]


def backward_trace(model, loss, batch: int):
    """The jaxpr of a training step's forward pass on `batch` examples that returns the vjp:
    its outputs are the residuals autodiff keeps. Traced once, counted for any model axis."""
    loss_of = loss_function(model, loss)

    def backward_function(weights, state, x, y):
        return jax.vjp(lambda w: loss_of(w, state, x, y), weights)[1]

    return jax.make_jaxpr(backward_function)(abstract(model.trainable_variables),
                                             abstract(model.non_trainable_variables),
                                             *abstract_inputs(model, batch))


def residual_bytes(traced, model, model_split: dict | None = None, model_size: int = 1) -> int:
    """Bytes of the residuals in `traced` (`backward_trace` of `model`), weights excluded.

    Those that are an input passed straight through (the weights and state)
    are not counted. With a `model` axis of `model_size` devices,
    `model_split` maps a weight's path to the dimension split over it; a
    residual that tensor parallelism splits (`planning.model_split`) then
    counts once per shard.
    """
    split = {}
    if model_size > 1 and model_split:
        variables = model.trainable_variables + model.non_trainable_variables
        dims = [model_split.get(v.path) for v in variables] + [None, None]
        split = model_split_lib.split_dims(traced.jaxpr, dims)
    inputs = {id(v) for v in traced.jaxpr.invars}
    total = 0.0
    for v in traced.jaxpr.outvars:
        if id(v) in inputs:
            continue
        is_split = not is_literal(v) and split.get(v) is not None
        total += nbytes(v) / model_size if is_split else nbytes(v)
    return round(total)


def step_temp_bytes(model, loss, batch: int) -> int:
    """XLA's temporary bytes for the compiled gradient of `batch` examples (what
    rematerialisation lowers), on this machine's first device."""
    grad = jax.jit(jax.grad(loss_function(model, loss)))
    compiled = grad.lower(abstract(model.trainable_variables), abstract(model.non_trainable_variables),
                          *abstract_inputs(model, batch)).compile()
    return compiled.memory_analysis().temp_size_in_bytes
