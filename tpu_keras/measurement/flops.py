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
recorded when it was built (`layer.input`, `layer.output`), and the arguments
each layer was called with (the model's config); layers inside a nested
functional model count too.
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
    call_kwargs = _call_kwargs(model)
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            total += forward_flops_per_example(layer)
            continue
        count = _layer_flops(layer, call_kwargs.get(layer.name, {}))
        if count is None:
            skipped.append(layer.name)
        else:
            total += count
    if skipped:
        logging.warning("FLOPs not counted for layers %s (no rule for their type)", skipped)
    return total


def _call_kwargs(model) -> dict:
    """{layer name: the keyword arguments of its first call}, from the model's config."""
    layers = model.get_config().get("layers", []) if hasattr(model, "get_config") else []
    return {layer["name"]: (layer.get("inbound_nodes") or [{}])[0].get("kwargs", {})
            for layer in layers if isinstance(layer, dict) and "name" in layer}


def _layer_flops(layer, kwargs):
    """Forward FLOPs of one layer per example; 0 if it has no matmul, None if unknown."""
    if not layer.weights:
        return 0
    try:
        inputs, outputs = keras.tree.flatten(layer.input), keras.tree.flatten(layer.output)
    except (AttributeError, ValueError):  # never called: no shapes to count from
        return 0
    if isinstance(layer, keras.layers.MultiHeadAttention):
        query, value = inputs[0], inputs[1]
        key = inputs[2] if len(inputs) > 2 else value
        lq, lk, lv = (_positions(t.shape) for t in (query, key, value))
        projections = 2 * (lq * _size(layer.query_dense) + lk * _size(layer.key_dense)
                           + lv * _size(layer.value_dense) + lq * _size(layer.output_dense))
        products = 2 * lq * lk * layer.num_heads * (layer.key_dim + (layer.value_dim or layer.key_dim))
        if kwargs.get("use_causal_mask"):
            products //= 2
        return projections + products
    if isinstance(layer, keras.layers.EinsumDense):
        kernel_in_output = math.prod(n for letter, n in zip(_kernel_spec(layer.equation), layer.kernel.shape)
                                     if letter in layer.equation.split("->")[1])
        if None in outputs[0].shape[1:]:
            return None
        return 2 * _size(layer) * math.prod(outputs[0].shape[1:]) // kernel_in_output
    if isinstance(layer, (keras.layers.Dense, keras.layers.Conv1D, keras.layers.Conv2D,
                          keras.layers.Conv3D)):
        if getattr(layer, "groups", 1) != 1 or None in outputs[0].shape[1:-1]:
            return None  # grouped, or built on a sequence of unknown length (Gemma 4's
            # per-layer projection, a direct child of its backbone)
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
