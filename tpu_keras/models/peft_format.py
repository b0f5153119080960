"""A LoRA run's factors as a PEFT adapter (DIR/export/peft/): what servers load.

`adapter_config.json` and `adapter_model.safetensors`, as PEFT's
`save_pretrained` writes them for a LoRA adapter of a transformers causal LM:
`peft.PeftModel.from_pretrained(base, DIR/export/peft)`, vLLM's
`--enable-lora --lora-modules name=DIR/export/peft`.

Module names. The adapter's weights are named after the transformers model
that keras-hub's exporter writes (`models/export.py`, the `transformers`
format): `base_model.model.<module>.lora_A.weight` for the exporter's
`<module>.weight`. Which exported weight each LoRA layer becomes, and where
each of its kernel's entries goes, is read from the exporter itself, not
from a table of our own: while the exporter runs, each LoRA layer's `kernel`
reads as the numbers 0, 1, 2, ... in its kernel's shape (int32, the first
one replaced by -(layer + 1), which names the layer), and the exporter's
reshapes and transposes carry them to the weight it writes. A weight that
holds one layer's numbers, each once, is that layer's module; the numbers
say which kernel entry sits at each place of the transformers matrix
(`(out_features, in_features)`). A layer that no weight holds whole (GPT-2,
whose exporter fuses the query, key and value into one `c_attn`, with the
key's floats) has no PEFT module: one line, and no adapter.

Factors. Keras 3.15's LoRA on an `EinsumDense` kernel of shape
`(..., last)` keeps `lora_kernel_a` of shape `(..., rank)` and
`lora_kernel_b` of shape `(rank, last)`, and adds
`(lora_alpha / rank) * a @ b` to the kernel. For keras-hub's query and value
kernels, `(hidden, heads, head_dim)` (Gemma: `(heads, hidden, head_dim)`),
`a` is `(hidden, heads, rank)`: each head has its own A, and B is shared by
the heads. As a matrix (out = heads x head_dim, in = hidden) that delta has
rank heads x rank, not rank; PEFT's LoRA is one `B (out, r) @ A (r, in)`,
so the adapter holds it exactly with r = heads x rank: A stacks the heads'
`a` slices (rank rows per head), B is block-diagonal with `b` on each head's
block. Each module has r = the largest of them (the query's: the value's,
with fewer key/value heads, is padded with zero rows of A and zero columns
of B), so that the adapter has one rank for every module, which every
server reads; and `lora_alpha = r * keras_alpha / keras_rank`, so that
PEFT's scaling `lora_alpha / r` is Keras's. An 8B Llama 3 (32 query heads)
at `model.lora_rank=16` gives r = 512.
"""

# Imported inside functions: safetensors (optional: absent on a plain install).
import contextlib
import json
import math
import os

import keras
import numpy as np

FOLDER = "peft"
BASE_FOLDER = "peft_base"  # the base model, in the transformers format, where none is named
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model


class Unsupported(Exception):
    """The backbone's LoRA layers do not map onto PEFT modules: the reason, one line."""


def lora_layers(backbone) -> list:
    """The backbone's LoRA layers (Keras `Dense`/`EinsumDense` with `lora_enabled`)."""
    return [layer for layer in backbone._flatten_layers(include_self=False)
            if getattr(layer, "lora_enabled", False)]


def modules(backbone, weights_map) -> dict:
    """{transformers module name: (LoRA layer, index)} where `index`, shaped as the
    transformers weight `(out_features, in_features)`, holds the flat index into the layer's
    kernel of the entry at each place. `weights_map(backbone)` is keras-hub's exporter's
    {name: tensor} (`hf_exporter.MODEL_EXPORTERS[...]`, as the transformers export runs it)."""
    layers = lora_layers(backbone)
    probes = {}
    for number, layer in enumerate(layers):
        shape = _kernel_shape(layer)
        if math.prod(shape) >= 2 ** 31:
            raise Unsupported(f"{layer.path}'s kernel {shape} has more entries than int32 counts")
        probe = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
        probe.flat[0] = -(number + 1)
        probes[id(layer)] = probe
    with _kernels_read_as(layers, probes):
        weights = weights_map(backbone)
    found = {}
    for name, tensor in weights.items():
        if "int" not in keras.backend.standardize_dtype(tensor.dtype):
            continue  # a weight of no LoRA layer's (only the probes are integers)
        index = np.array(keras.ops.convert_to_numpy(tensor))
        markers = np.flatnonzero(index < 0)
        if len(markers) != 1 or index.ndim != 2 or not name.endswith(".weight"):
            raise Unsupported(f"keras-hub's exporter writes {name} {list(index.shape)} from parts "
                              "of several LoRA layers")
        layer = layers[-int(index.flat[markers[0]]) - 1]
        index.flat[markers[0]] = 0
        if (index.size != math.prod(_kernel_shape(layer))
                or np.any(np.bincount(index.ravel(), minlength=index.size) != 1)):
            raise Unsupported(f"keras-hub's exporter writes {name} from part of {layer.path}'s kernel")
        found[name[:-len(".weight")]] = (layer, index)
    missing = [layer.path for layer in layers if all(layer is not l for l, _ in found.values())]
    if missing:
        others = len(missing) - 1
        more = f" (and {others} other LoRA kernel{'s' if others > 1 else ''})" if others else ""
        raise Unsupported(f"keras-hub's exporter writes {missing[0]}'s kernel{more} into no weight "
                          "of its own (GPT-2's fuses query, key and value), so PEFT has no module for it")
    return found


def factors(layer, index) -> tuple:
    """(A (r, in_features), B (out_features, r), scaling) with `scaling * B @ A` equal to
    the layer's LoRA delta `(lora_alpha / rank) * a @ b`, placed as `index` says, exactly:
    r is the rank times the product of the kernel axes that feed the output besides the
    last (the heads)."""
    shape = _kernel_shape(layer)
    coords = np.unravel_index(index, shape)  # the kernel's indices at each (out, in) place
    last, inner = coords[-1], coords[:-1]
    if np.any(last != last[:, :1]):
        raise Unsupported(f"{layer.path}: the exporter's weight does not keep the kernel's last "
                          "axis (the LoRA B factor's) in its rows, as (out_features, in_features)")
    in_axes, out_axes = [], []
    for axis, coord in enumerate(inner):  # each axis indexes either inputs or outputs
        if np.all(coord == coord[:1, :]):
            in_axes.append(axis)
        elif np.all(coord == coord[:, :1]):
            out_axes.append(axis)
        else:
            raise Unsupported(f"{layer.path}: kernel axis {axis} mixes the exported weight's "
                              "rows and columns")
    a = np.asarray(keras.ops.convert_to_numpy(layer.lora_kernel_a), "float32")  # (..., rank)
    b = np.asarray(keras.ops.convert_to_numpy(layer.lora_kernel_b), "float32")  # (rank, last)
    rank = b.shape[0]
    out_features, in_features = index.shape
    group_sizes = [shape[axis] for axis in out_axes]
    groups = math.prod(group_sizes)  # the heads: each its own A
    group_of_row = (np.ravel_multi_index([coords[axis][:, 0] for axis in out_axes], group_sizes)
                    if out_axes else np.zeros(out_features, int))
    group_coords = np.unravel_index(np.arange(groups), group_sizes) if out_axes else ()
    picks = tuple(coords[axis][0, :][None, :] if axis in in_axes
                  else group_coords[out_axes.index(axis)][:, None] for axis in range(len(inner)))
    lora_a = a[picks].transpose(0, 2, 1).reshape(groups * rank, in_features)
    lora_b = np.zeros((out_features, groups, rank), "float32")
    lora_b[np.arange(out_features), group_of_row, :] = b[:, last[:, 0]].T
    return lora_a, lora_b.reshape(out_features, groups * rank), float(layer.lora_alpha) / layer.lora_rank


def adapter(found: dict) -> tuple[dict, int, float]:
    """({safetensors key: array}, r, lora_alpha) of the modules `found` (`modules`), every
    module padded to one rank r, with PEFT's scaling lora_alpha / r Keras's own."""
    made = {name: factors(layer, index) for name, (layer, index) in found.items()}
    r = max(lora_a.shape[0] for lora_a, _, _ in made.values())
    scaling = next(iter(made.values()))[2]  # keras-hub enables every layer with one alpha
    tensors = {}
    for name, (lora_a, lora_b, own) in sorted(made.items()):
        padded_a = np.zeros((r, lora_a.shape[1]), "float32")
        padded_a[:lora_a.shape[0]] = lora_a
        padded_b = np.zeros((lora_b.shape[0], r), "float32")
        padded_b[:, :lora_b.shape[1]] = lora_b * (own / scaling)
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = padded_a
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = padded_b
    alpha = r * scaling
    return tensors, r, int(alpha) if float(alpha).is_integer() else alpha


def write(folder: str, found: dict, base: str) -> dict:
    """Writes the adapter of `found` (`modules`) into the local `folder`; returns its config."""
    from safetensors.numpy import save_file
    tensors, r, alpha = adapter(found)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in found}),
        "base_model_name_or_path": base,
        "bias": "none",  # the LoRA layers' biases are frozen (models/hub.py)
        "lora_dropout": 0.0,  # Keras's LoRA has none
        "fan_in_fan_out": False,  # lora_A (r, in_features), lora_B (out_features, r)
        "inference_mode": True,
        "use_rslora": False,
        "modules_to_save": None,
    }
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(folder, CONFIG_FILE), "w") as file:
        json.dump(config, file, indent=2)
    return config


def zero_deltas(backbone) -> None:
    """Sets every LoRA B factor to zero: the backbone's merged kernels are then its base's."""
    for layer in lora_layers(backbone):
        layer.lora_kernel_b.assign(np.zeros(layer.lora_kernel_b.shape, layer.lora_kernel_b.dtype))


def _kernel_shape(layer) -> tuple:
    return tuple(layer.lora_kernel_a.shape[:-1]) + (layer.lora_kernel_b.shape[-1],)


@contextlib.contextmanager
def _kernels_read_as(layers, probes):
    """While open, `layer.kernel` of each of `layers` is `probes[id(layer)]`; every other
    layer's reads as before. Keras's `kernel` is a property of the layer's class (it adds
    the LoRA delta), so the class's property is wrapped, and put back on closing."""
    patched = []
    for cls in {type(layer) for layer in layers}:
        own = cls.__dict__.get("kernel")
        inherited = getattr(cls, "kernel")

        def read(self, inherited=inherited):
            probe = probes.get(id(self))
            return inherited.fget(self) if probe is None else probe

        cls.kernel = property(read)
        patched.append((cls, own))
    try:
        yield
    finally:
        for cls, own in patched:
            if own is None:
                del cls.kernel
            else:
                cls.kernel = own
