"""Activation memory of a training step: what autodiff keeps for the backward pass.

With rematerialisation off, every intermediate the backward pass needs (the
"residuals" of the forward pass) is alive at once at the step's peak. JAX
traces the model's loss on abstract values and lists the residuals it would
save, so the estimate is exact about shapes and dtypes (bf16 activations
under mixed precision, attention's seq x seq scores) and allocates nothing.
Not every residual is a buffer the compiler keeps; the estimate counts one
that is, and leaves out:

- weights passed straight through: they are already counted as parameters, and so are
  slices of them (an expert bank's gate half), which the compiler reads in place;
- a value listed twice (one tensor that several backward rules need);
- constants, computed from no input (a causal mask from `iota`, an array of
  -inf): the compiler makes them where they are used;
- a residual that cheap elementwise work makes from another residual (a
  float32 copy of a bf16 activation, softmax's normalised output from its
  exponentials): the compiler fuses that work into the backward pass and
  keeps the one it came from.

The check is the compiled step's own buffer assignment (`python -m
tpu_keras.plan --measure`: the TPU compiler, `planning.tpu_compiler`, or
XLA:CPU, `planning.compiled_step`).
"""

# Imported inside functions: Keras, through models.grpo and models.chunked_loss (the engine must
# be selected first: engine.select).
import math

import jax

from tpu_keras.planning import model_split as model_split_lib
from tpu_keras.planning.jaxpr_walk import Producers, aval, is_literal, nbytes


def abstract_inputs(model, batch: int):
    """Shapes of one batch: the model's input, and integer labels for a sparse loss; for
    GRPO's group model, its sampled tokens, `y_true` and the sample weights."""
    from tpu_keras.models import grpo
    if isinstance(model, grpo.GroupModel):
        length = model.policy.inputs[0].shape[1]
        return (jax.ShapeDtypeStruct((batch, length + 1), "int32"),
                jax.ShapeDtypeStruct((batch, length, 3), "float32"),
                jax.ShapeDtypeStruct((batch, length), "float32"))
    inputs, outputs = model.inputs[0], model.outputs[0]
    x = jax.ShapeDtypeStruct((batch, *inputs.shape[1:]), inputs.dtype)
    y = jax.ShapeDtypeStruct((batch, *outputs.shape[1:-1]), "int32")
    return x, y


def loss_function(model, loss):
    """loss(weights, state, x, y): the model's training loss as a pure function of its weights
    (a head split by `train.loss_chunks` gives each token's loss, as in a run's step)."""
    from tpu_keras.models import chunked_loss

    def loss_of(weights, state, x, y):
        with chunked_loss.targets(y):
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


def residual_bytes(traced, model, model_split: dict | None = None, model_size: int = 1,
                   stream: tuple | None = None) -> int:
    """Bytes of the residuals in `traced` (`backward_trace` of `model`) that the compiler
    keeps (the module's docstring says which those are).

    With a `model` axis of `model_size` devices, `model_split` maps a weight's
    path to the dimension split over it; a residual that tensor parallelism
    splits (`planning.model_split`) then counts once per shard. `stream`, (tokens,
    width) of the residual stream, says the stream is split along the sequence over
    `model` too (`layout.sequence_parallel`): a whole residual of that shape counts
    once per shard as well.
    """
    split = {}
    if model_size > 1 and model_split:
        variables = model.trainable_variables + model.non_trainable_variables
        dims = [model_split.get(v.path) for v in variables] + [None, None]
        split = model_split_lib.split_dims(traced.jaxpr, dims)
    producers = Producers(traced.jaxpr)
    kept = {}  # each residual once, by the value it is
    for v in traced.jaxpr.outvars:
        if is_literal(v):
            continue
        value = producers.value(v)
        if value not in producers.inputs and not producers.is_constant(value):
            kept.setdefault(value, v)
    total = 0.0
    for value, v in kept.items():
        if _made_from_another(value, kept, producers):
            continue
        in_stream = stream is not None and tuple(v.aval.shape[1:]) == tuple(stream)
        total += nbytes(v) / model_size if split.get(v) is not None or in_stream else nbytes(v)
    return round(total)


# Keep their one input's elements, in another shape or dtype.
_MOVES = ("convert_element_type", "copy", "copy_p", "reduce_precision", "reshape", "transpose",
          "squeeze", "expand_dims", "broadcast_in_dim")
# Output shaped like an operand, but not elementwise: never fused away as cheap.
_NOT_ELEMENTWISE = ("dot_general", "conv_general_dilated", "cumsum", "cumprod", "cummax", "cummin",
                    "cumlogsumexp", "sort", "dynamic_update_slice", "scatter", "scatter-add",
                    "scatter_add", "select_and_scatter_add", "pallas_call", "custom_call",
                    "while", "scan", "cond", "reduce_window_sum", "reduce_window")


def _made_from_another(value, kept, producers) -> bool:
    """Whether cheap elementwise steps make `value` from another kept residual: each step
    reads one operand of the output's size, anything else it reads being smaller (a
    row's max or sum, a bias) or a constant."""
    current, sliced = value, False
    while True:
        made = producers.made_by(current)
        if made is None:
            return False
        name, operands = made
        operands = [v for v in operands if not producers.is_constant(v)]
        shape = aval(current).shape
        if name in _MOVES or name == "slice":
            full = operands[:1]
            sliced = sliced or name == "slice"
        elif name in _NOT_ELEMENTWISE:
            return False
        else:
            full = [v for v in operands if producers.unbroadcast_size(v) == math.prod(shape)]
            if any(aval(v).shape != shape for v in full):
                return False
        if len(full) != 1:
            return False
        current = full[0]
        if sliced and current in producers.inputs:
            return True  # a slice of a weight
        if current in kept:
            return not sliced  # a slice of a kept activation counts apart, as a buffer of its own


def step_temp_bytes(model, loss, batch: int) -> int:
    """XLA's temporary bytes for the compiled gradient of `batch` examples (what
    rematerialisation lowers), on this machine's first device."""
    grad = jax.jit(jax.grad(loss_function(model, loss)))
    compiled = grad.lower(abstract(model.trainable_variables), abstract(model.non_trainable_variables),
                          *abstract_inputs(model, batch)).compile()
    return compiled.memory_analysis().temp_size_in_bytes
