"""A LoRA run's factors in keras-hub's own file (DIR/export/lora.weights.h5), where keras-hub can read them.

keras-hub 0.32's `backbone.load_lora_weights(path)` reads the rank the file
names, calls Keras's `enable_lora(rank)` on the backbone's layers named
`query` and `value` (its `default_lora_layer_names`), with Keras's default
alpha (the rank: scaling 1), and assigns each such layer the file's
`lora_kernel_a` and `lora_kernel_b`, Keras's shapes: A of the kernel's shape
with its last axis replaced by the rank, B (rank, the kernel's last axis).

Keras's A is per head where a kernel has output axes besides its last (the
query's and the value's heads), so it holds PEFT's factors exactly at a
larger rank: A' stacks, for each head, A in that head's place and zeros
elsewhere, and B' stacks the heads' slices of B, the run's scaling folded in.
For keras-hub's query, (hidden, heads, head_dim), that is rank
`model.lora_rank` x heads, each layer padded with zeros to the largest (the
query's: the value may have fewer heads). The file is then keras-hub's
model exactly, at heads times the adapter's size; the PEFT adapter
(`peft_format`) is the compact form. A run that adapts any other projection
has no such file: keras-hub's loader adapts the query and the value alone.
"""

import math

import keras
import numpy as np

from tpu_keras.models import lora

FILE = "lora.weights.h5"
# PEFT's names of the layers keras-hub's load_lora_weights adapts (`query`, `value`).
KERAS_HUB_MODULES = ("q_proj", "v_proj")


def refusal(settings, backbone) -> str | None:
    """Why keras-hub's loader cannot read a run of these LoRA settings on `backbone`, or None."""
    others = [module for module in settings.modules if module not in KERAS_HUB_MODULES]
    if others or settings.parameters:
        adapted = (f"{', '.join(others)} (model.lora_targets)" if others else
                   f"the experts' {', '.join(settings.parameters)} (model.lora_target_parameters)")
        return (f"export format 'lora' is keras-hub's load_lora_weights file, which adapts the "
                f"query and value projections alone, and this run also adapted {adapted}; the "
                "'peft' adapter holds every one of them")
    if not _keras_hub_rows(backbone):  # SmolLM3's are q_proj and v_proj: its loader finds none
        return (f"export format 'lora' is keras-hub's load_lora_weights file, and keras-hub 0.32's "
                f"loader adapts no layer of {type(backbone).__name__} (it looks for layers named "
                f"{', '.join(backbone.default_lora_layer_names())}); the 'peft' adapter holds the factors")
    return None


def _keras_hub_rows(backbone) -> list:
    """(index among the layers with weights, layer) of the layers keras-hub's loader adapts."""
    return [(index, layer) for index, layer in enumerate(
        layer for layer in backbone._flatten_layers(include_self=False) if layer.weights)
        if layer.name in backbone.default_lora_layer_names() and hasattr(layer, "enable_lora")]


def write(backbone, path: str) -> None:
    """Writes the adapted `backbone`'s factors as keras-hub's `save_lora_weights` would for
    the same model, to the local file `path`."""
    rows = _keras_hub_rows(backbone)
    factors = {index: _as_keras(layer) for index, layer in rows}
    rank = max(a.shape[-1] for a, _ in factors.values())
    store = keras.src.saving.saving_lib.H5IOStore(path, mode="w")  # as save_lora_weights fills it
    store.make("lora")["rank"] = rank
    for index, (a, b) in factors.items():
        inner = store.make(f"lora/{index}")
        inner["lora_kernel_a"] = _padded(a, -1, rank)
        inner["lora_kernel_b"] = _padded(b, 0, rank)
    store.close()


def _as_keras(layer) -> tuple[np.ndarray, np.ndarray]:
    """(A', B') in Keras's shapes whose `A' @ B'` is the layer's update (zeros for a layer
    the run did not adapt): A' (kernel[:-1] + (r',)), B' (r', kernel[-1])."""
    shape = tuple(int(n) for n in layer.kernel.shape)
    adapter = getattr(layer, "_tpu_keras_lora", None)
    if adapter is None:
        return np.zeros(shape[:-1] + (1,), "float32"), np.zeros((1, shape[-1]), "float32")
    last = len(shape) - 1
    if last not in adapter.outputs:
        raise ValueError(f"{layer.path}: the kernel's last axis is not an output axis")
    heads = adapter.outputs[:-1]  # output axes besides the last: one A per entry in Keras's
    count = math.prod(shape[axis] for axis in heads)
    rank = adapter.settings.rank
    a = np.asarray(keras.ops.convert_to_numpy(layer.lora_a), "float32")  # (in..., r)
    b = np.asarray(keras.ops.convert_to_numpy(layer.lora_b), "float32")  # (r, out...)
    spread = a.reshape([shape[i] if i in adapter.inputs else 1 for i in range(last)] + [rank])
    onehot = np.eye(count, dtype="float32").reshape(
        [shape[i] if i in heads else 1 for i in range(last)] + [count])
    stacked = spread[..., :, None] * onehot[..., None, :]  # kernel[:-1] + (r, heads)
    keras_a = stacked.reshape(shape[:-1] + (rank * count,))
    keras_b = (b * adapter.settings.scaling).reshape(rank * count, shape[-1])
    return keras_a, keras_b


def _padded(array: np.ndarray, axis: int, size: int) -> np.ndarray:
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, size - array.shape[axis])
    return np.pad(array, widths)
