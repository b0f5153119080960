"""Attention over a sequence split along the mesh's `context` axis: keys and values gathered.

With `mesh.context` n above 1, each device holds 1/n of every sequence's
tokens, in order (`parallelism.distribution` lays the batch and every
layer's output so), and so 1/n of each layer's activations. Everything a
transformer computes token by token needs nothing more; attention needs
every earlier key and value. Here each device keeps its own queries and
gathers the keys and values of the whole sequence along `context` (MaxText's
default strategy, `context_parallel_strategy="all_gather"`, which it calls
cheap beside the attention it feeds): the families' attention layers
(`Family.attention`) constrain `_compute_attention`'s query to the split and
its keys, values and mask to the whole sequence, and the compiler inserts
the all-gathers (and, backward, the reduce-scatters). Rotary positions and
the examples of a packed row are those of the whole sequence, since the
tokens keep their order.

Each device then attends its queries to every key, the causal mask's zeros
included: the work is even across the axis. On a TPU the fused kernel
(`models.splash_attention`, routed over these layers, which stay its
fallback) takes a split sequence the same way: its own queries, the gathered
keys and values, the mask's rows of its queries. It skips masked blocks, so
there the device of the first tokens has the least to do; reordering the
sequence to even that out (MaxText's load balancing) is not done here.
"""

# Imported inside functions: JAX (optional: the jax engine's alone, which a context axis needs).
import functools

import keras

from tpu_keras.models import families
from tpu_keras.parallelism.mesh import BATCH_AXES, CONTEXT

_GATHERED: list = []  # the layers whose keys and values a trace gathered, for the tests' check


def route(model, mesh: dict) -> int:
    """Makes the families' attention layers of `model` gather keys and values along `context`
    where `mesh` (the resolved mesh) splits sequences; returns how many layers."""
    if mesh.get(CONTEXT, 1) <= 1:
        return 0
    attention = {name for family in families.known() for name in family.attention}
    routed = 0
    for layer in model._flatten_layers(include_self=False):
        if type(layer).__name__ in attention and not getattr(layer, "_tpu_keras_context", False):
            object.__setattr__(layer, "_compute_attention",
                               functools.partial(_gathered, layer._compute_attention, layer=layer))
            object.__setattr__(layer, "_tpu_keras_context", True)
            routed += 1
    return routed


def gathered_layers() -> list[str]:
    """The paths of the layers whose keys and values a trace of this process gathered."""
    return list(dict.fromkeys(_GATHERED))


def _gathered(compute, query, key, value, attention_mask=None, *args, layer, **kwargs):
    distribution = keras.distribution.distribution()
    mesh = distribution.device_mesh.backend_mesh if distribution is not None else None
    if mesh is None or mesh.shape.get(CONTEXT, 1) <= 1 or key.shape[1] != query.shape[1]:
        return compute(query, key, value, attention_mask, *args, **kwargs)  # no split; a cache
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    def placed(tensor, sequence):
        heads = ("model" if len(tensor.shape) == 4 and tensor.shape[2] % mesh.shape.get("model", 1) == 0
                 else None)
        spec = (BATCH_AXES, sequence) + ((heads, None) if len(tensor.shape) == 4 else
                                         (None,) * (len(tensor.shape) - 2))
        return jax.lax.with_sharding_constraint(tensor, NamedSharding(mesh, PartitionSpec(*spec)))

    query = placed(query, CONTEXT)            # this device's tokens
    key, value = placed(key, None), placed(value, None)  # every token of the sequence
    if attention_mask is not None and len(attention_mask.shape) == 3:  # (batch, queries, keys)
        attention_mask = jax.lax.with_sharding_constraint(
            attention_mask, NamedSharding(mesh, PartitionSpec(BATCH_AXES, CONTEXT, None)))
    _GATHERED.append(layer.path)
    return placed(compute(query, key, value, attention_mask, *args, **kwargs), CONTEXT)
