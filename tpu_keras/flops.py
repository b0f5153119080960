"""Model FLOPs per training example, counted from the model's matmuls.

The convention of MaxText's performance-metrics reference, so MFU figures
compare across tools: only matrix products count (embedding lookups, norms,
activations and the softmax do not), a training step costs three forward
passes (the backward pass two), and causal attention computes half of its
score and context products.

Per example, forward:
- Dense, EinsumDense, Conv: 2 x kernel size x the positions it is applied at;
- MultiHeadAttention: its four projections as above, plus the score and
  context products, 2 x Lq x Lk x heads x (key_dim + value_dim), halved
  when the layer is called with `use_causal_mask=True`.

Counted from the layers of a functional (or Sequential) model and the shapes
recorded when it was built; layers inside a nested functional model count too.
"""

import math

from absl import logging
import keras

TRAINING_PASSES = 3  # forward + backward (which costs two forwards)


def training_flops_per_example(model: keras.Model) -> int:
    """Matmul FLOPs one training example costs: 3 x the forward count."""
    return TRAINING_PASSES * forward_flops_per_example(model)


def forward_flops_per_example(model: keras.Model) -> int:
    total, skipped = 0, []
    for layer in model.layers:
        if isinstance(layer, keras.Model) and hasattr(layer, "_inbound_nodes"):
            total += forward_flops_per_example(layer)
            continue
        count = _layer_flops(layer)
        if count is None:
            skipped.append(layer.name)
        else:
            total += count
    if skipped:
        logging.warning("FLOPs not counted for layers %s (no rule for their type)", skipped)
    return total


def _layer_flops(layer):
    """Forward FLOPs of one layer per example; 0 if it has no matmul, None if unknown."""
    if not layer.weights or not getattr(layer, "_inbound_nodes", None):
        return 0
    node = layer._inbound_nodes[0]  # shapes as built: Keras keeps them on the node
    inputs, outputs = node.input_tensors, node.output_tensors
    if isinstance(layer, keras.layers.MultiHeadAttention):
        query, value = inputs[0], inputs[1]
        key = inputs[2] if len(inputs) > 2 else value
        lq, lk, lv = (_positions(t.shape) for t in (query, key, value))
        projections = 2 * (lq * _size(layer._query_dense) + lk * _size(layer._key_dense)
                           + lv * _size(layer._value_dense) + lq * _size(layer._output_dense))
        products = 2 * lq * lk * layer._num_heads * (layer._key_dim + (layer._value_dim or layer._key_dim))
        if node.arguments.kwargs.get("use_causal_mask"):
            products //= 2
        return projections + products
    if isinstance(layer, keras.layers.EinsumDense):
        kernel_in_output = math.prod(n for letter, n in zip(_kernel_spec(layer.equation), layer.kernel.shape)
                                     if letter in layer.equation.split("->")[1])
        return 2 * _size(layer) * math.prod(outputs[0].shape[1:]) // kernel_in_output
    if isinstance(layer, (keras.layers.Dense, keras.layers.Conv1D, keras.layers.Conv2D,
                          keras.layers.Conv3D)):
        if getattr(layer, "groups", 1) != 1:
            return None
        return 2 * _size(layer) * _positions(outputs[0].shape)
    if isinstance(layer, keras.layers.Embedding) or not any(
            "kernel" in w.path.rsplit("/", 1)[-1] for w in layer.weights):
        return 0  # lookups, norms, biases only: no matmul
    return None


def _positions(shape) -> int:
    """How many times a layer's kernel is applied per example: all but batch and features."""
    return math.prod(shape[1:-1])


def _size(layer) -> int:
    return math.prod(layer.kernel.shape)


def _kernel_spec(equation: str) -> str:
    return equation.split("->")[0].split(",")[1]
