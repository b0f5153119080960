"""A frozen base in int8 or int4 under LoRA (`model.quantize`): QLoRA's idea, Keras's quantizers.

Every Dense and EinsumDense layer of the backbone (the attention and MLP
projections; the embeddings and the output head stay in the model's dtype)
is quantized with Keras 3's own `layer.quantize`, weight-only: int8 with one
scale per output feature, or int4 (two values a byte) per output feature.
The activations stay in the compute dtype, as QLoRA keeps them. LoRA's
factors then train in float32 over the frozen quantized kernels
(`models.lora`), and the memory a base takes falls to about a half (int8)
or a quarter (int4) of its bfloat16 size.

It happens once the checkpoint has loaded, layer by layer: Keras quantizes a
layer's kernel in host memory (its quantizers run on NumPy), and the
quantized kernel and its scales go to the devices as their shards
(`parallelism.host_placement`), so no weight is whole on one device. The
float model itself must still fit the slice while it loads; a model whose
bfloat16 weights do not (a 70B on a v5litepod-8) needs them quantized as
they are read, which this does not do yet. Built without values (`plan`),
the layers are given their quantized variables' shapes alone.

Keras lays an int4 EinsumDense kernel out as a matrix, (input features,
output features / 2), where the float kernel had the einsum's axes: its
layout rule is derived here from the float kernel's (`rules`); the scales
are small (one float per output feature) and stay whole on every device.
"""

# Imported inside functions: JAX (optional: the jax engine's alone, which `check` demands).
import math
from typing import Sequence

import keras
import numpy as np

from tpu_keras.errors import UserError
from tpu_keras.parallelism import Rule, matching_rules, replicated

MODES = ("int8", "int4")
# Keras's other modes, and why LoRA cannot train over them here.
_REFUSED = {
    "gptq": "Keras 3.15's GPTQ kernels take no LoRA (enable_lora refuses them) and need "
            "calibration data",
    "awq": "AWQ kernels need calibration data, and the toolkit's LoRA does not follow them",
    "float8": "float8 is a training dtype for the whole model (its kernels keep training), "
              "not a frozen base",
}


def check(mode: str, lora_rank: int) -> None:
    """One `error:` line where `model.quantize` cannot be used as given."""
    if not mode:
        return
    if mode in _REFUSED:
        raise UserError(f"model.quantize={mode!r}: {_REFUSED[mode]}; choose "
                        f"{' or '.join(repr(m) for m in MODES)} for a frozen base under LoRA")
    if mode not in MODES:
        raise UserError(f"model.quantize={mode!r} is not a mode; choose "
                        f"{' or '.join(repr(m) for m in MODES)}, or '' for a float base")
    if not lora_rank:
        raise UserError(f"model.quantize={mode!r} freezes a quantized base for LoRA to train "
                        "over, and this run has no LoRA: set model.lora_rank (16, say), or "
                        "train in float and quantize the exported model for serving")
    if keras.backend.backend() != "jax":
        raise UserError(f"model.quantize={mode!r} runs on the jax engine: set "
                        "--config.engine=jax (install the [jax] extra)")


def quantize_base(backbone, mode: str, targets: Sequence) -> list:
    """Quantizes the projections of `backbone` its family names (`targets`: `lora.Target`s)
    to `mode`, weight-only; returns the quantized layers."""
    done = []
    for layer in backbone._flatten_layers(include_self=False):
        path = getattr(layer, "path", "") or ""
        if not any(target.block(path) is not None for target in targets):
            continue
        if type(layer) not in (keras.layers.Dense, keras.layers.EinsumDense):
            raise UserError(f"{path} is a {type(layer).__name__}; model.quantize quantizes Dense "
                            "and EinsumDense projections: use a float base for this model")
        if _has_values(layer):
            layer.quantize(mode, config=_weights_only(mode))
        else:
            _quantized_shapes(layer, mode)
        if mode == "int4":
            _keep_the_kernel_packed(layer)
        done.append(layer)
    return done


def _keep_the_kernel_packed(layer) -> None:
    """The layer's int4 product, in place of Keras 3.15's `_int4_call`, whose backward pass
    keeps each layer's unpacked kernel (a byte per weight) from the forward pass until
    it is used: for a whole model that is a second base in memory (the 8B Llama of
    docs/fine_tuning.md: 16.6 GiB of the TPU compiler's temporaries on one v5e chip). Here
    the backward pass unpacks it again from the packed kernel."""
    import jax
    equation = layer.equation if isinstance(layer, keras.layers.EinsumDense) else None
    shape = tuple(layer.kernel.shape)  # the float kernel's

    def dequantized(packed, scale, dtype):
        columns = math.prod(shape[1:]) if equation is None else layer._int4_unpacked_column_size
        whole = keras.quantizers.unpack_int4(packed, columns, axis=-1, dtype="int8")
        return keras.ops.reshape(keras.ops.cast(whole, dtype) / keras.ops.cast(scale, dtype), shape)

    def product(x, kernel):
        return keras.ops.matmul(x, kernel) if equation is None else keras.ops.einsum(equation, x, kernel)

    def input_gradient(upstream, kernel):
        if equation is None:
            return keras.ops.matmul(upstream, keras.ops.transpose(kernel))
        return keras.ops.einsum(layer._custom_gradient_equation, upstream, kernel)

    @keras.ops.custom_gradient
    def int4_product(x, packed, scale):
        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            # Unpacked again here, once the gradient has arrived. Without the barrier XLA merges
            # this unpacking with the forward pass's and keeps its result; JAX's own
            # rematerialisation keeps its recomputations apart the same way.
            again, scale_again, upstream = jax.lax.optimization_barrier((packed, scale, upstream))
            kernel = dequantized(again, scale_again, upstream.dtype)
            return input_gradient(upstream, kernel), None, None
        return product(x, dequantized(packed, scale, x.dtype)), grad

    def quantized_call(inputs, training=None):
        outputs = int4_product(inputs, layer._kernel, layer.kernel_scale)
        if layer.bias is not None:
            outputs = outputs + keras.ops.cast(layer.bias, outputs.dtype)
        return outputs if layer.activation is None else layer.activation(outputs)

    object.__setattr__(layer, "quantized_call", quantized_call)  # this layer's own


def rules(kernel_rules: Sequence[Rule], targets: Sequence, mode: str) -> list[Rule]:
    """Layout rules of the quantized variables, from the float kernels' (`kernel_rules`): every
    scale whole (one float per output feature), and, for int4, each kernel Keras packs into a
    matrix, (input features, output features / 2), split as the float kernel's first input
    and first output axes are. A rule for one path in another rank is the Placer's to pick."""
    made = []
    for target in targets:
        made.append(replicated(f"{target.pattern}/kernel_scale"))
        matching = matching_rules(kernel_rules, target.kernel)
        axes = matching[0].axes if matching else ()
        if mode == "int4" and len(axes) > 2:
            outputs = target.outputs(len(axes))
            made.append(Rule(f"{target.pattern}/kernel", (axes[target.inputs[0]], axes[outputs[0]])))
    return made


def is_quantized(layer) -> bool:
    return getattr(layer, "quantization_mode", None) in MODES


def float_kernel(layer) -> np.ndarray:
    """The quantized layer's kernel dequantized (float32, the float kernel's shape): what the
    merged exports hold."""
    kernel = np.asarray(keras.ops.convert_to_numpy(layer.kernel), "float32")  # whole values
    scale = np.asarray(keras.ops.convert_to_numpy(layer.kernel_scale), "float32")
    if isinstance(layer, keras.layers.EinsumDense):
        if layer.quantization_mode == "int4":  # one scale per column of the flattened kernel
            rows = math.prod(kernel.shape[axis] for axis in layer._kernel_reduced_axes)
            return (kernel.reshape(rows, -1) / scale).reshape(kernel.shape)
        scale = np.asarray(keras.ops.convert_to_numpy(layer._adjust_scale_for_dequant(scale)))
    return kernel / scale


def _weights_only(mode: str):
    if mode == "int8":
        return keras.quantizers.Int8QuantizationConfig(activation_quantizer=None)
    return keras.quantizers.Int4QuantizationConfig(block_size=-1)  # one scale per output feature


def _has_values(layer) -> bool:
    """Whether the layer's kernel holds a value (not a model built for `plan` alone)."""
    return getattr(layer._kernel, "_value", True) is not None


def _quantized_shapes(layer, mode: str) -> None:
    """What `layer.quantize` leaves behind, without the values: the quantized variables and
    the quantized dtype policy (`plan` compiles for their shapes)."""
    config = _weights_only(mode)
    shape = tuple(layer._kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense):
        layer._set_quantization_info()
    layer._tracker.unlock()
    del layer._kernel
    layer.quantized_build(shape, mode, config)
    layer._tracker.lock()
    layer.quantization_config = config
    policy = "int8" if mode == "int8" else "int4/-1"
    layer.dtype_policy = keras.dtype_policies.get(f"{policy}_from_{layer.dtype_policy.name}")
