"""`train.remat = "blocks"`: each transformer block recomputed in the backward pass.

A block's forward pass keeps what its backward pass needs: its activations
and, under fsdp, its gathered weights. XLA gathers a block's weights for the
forward product and keeps them until the backward one, so every device holds
the whole model through the step. Recomputing each block in the backward
pass keeps only the block's input: the block runs forward once more, and
under fsdp its weights are gathered again (its all-gathers count twice).
MaxText's rematerialisation of each decoder layer makes the same trade.

Keras's `RematScope(mode="full")` would do it for every layer, but Keras 3.15
passes a layer's Python arguments (`training`, a mask of `None`) through
`jax.checkpoint` as arrays, and keras-hub's attention fails on them
(docs/design.md). Here a block's call is wrapped whole: its tensors go
through `keras.remat`, its other arguments are held as given.
"""

import functools

import keras


def blocks(model) -> list:
    """The transformer blocks of the keras-hub backbones in `model` (`transformer_layers`)."""
    found = []
    for layer in model._flatten_layers(include_self=True):
        found.extend(getattr(layer, "transformer_layers", None) or ())
    return found


def apply(model) -> int:
    """Makes each block of `model` recompute in the backward pass; returns how many."""
    found = blocks(model)
    for block in found:
        block.call = _recomputed(block.call)
    return len(found)


def _recomputed(call):
    @functools.wraps(call)
    def recomputed_call(*args, **kwargs):
        tensor_args = [i for i, value in enumerate(args) if _holds_tensors(value)]
        tensor_kwargs = {key: value for key, value in kwargs.items() if _holds_tensors(value)}

        def forward(tensors, named):
            full = list(args)
            for i, value in zip(tensor_args, tensors):
                full[i] = value
            return call(*full, **{**kwargs, **named})

        return keras.remat(forward)([args[i] for i in tensor_args], tensor_kwargs)
    return recomputed_call


def _holds_tensors(value) -> bool:
    return any(keras.ops.is_tensor(leaf) for leaf in keras.tree.flatten(value))
