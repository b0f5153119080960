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

int4 comes in groups by default (`model.quantize_block_size`, 128): every
128 input features of an output feature share a scale and a zero point, as
GPTQ, AWQ and QLoRA's 64-wide blocks do, Keras's `block_size`; -1 gives one
scale per output feature. int8 is per output feature (Keras's int8 has no
groups).

Keras lays an int4 kernel out as a matrix, (input features, output features
/ 2), where an EinsumDense kernel had the einsum's axes: its layout rule is
derived here from the float kernel's (`rules`). Per output feature, the
scales are small and stay whole on every device; in groups, the scales and
zero points, (groups, output features), are split as the kernel is, so
each device holds those of its own slice.
"""

# Imported inside functions: JAX (optional: the jax engine's alone, which `check` demands).
import contextlib
import math
from typing import Sequence

import keras
import numpy as np

from tpu_keras.errors import UserError
from tpu_keras.parallelism import Rule, matching_rules, replicated

MODES = ("int8", "int4")
DEFAULT_INT4_BLOCK = 128  # model.quantize_block_size=0: GPTQ's and AWQ's usual group
PER_FEATURE = -1  # Keras's block_size for one scale per output feature
# Keras's other modes, and why LoRA cannot train over them here.
_REFUSED = {
    "gptq": "Keras 3.15's GPTQ kernels take no LoRA (enable_lora refuses them) and need "
            "calibration data",
    "awq": "AWQ kernels need calibration data, and the toolkit's LoRA does not follow them",
    "float8": "float8 is a training dtype for the whole model (its kernels keep training), "
              "not a frozen base",
}


def block_size(mode: str, given: int = 0) -> int:
    """The block size `model.quantize_block_size` means for `mode`: int4's groups
    (`DEFAULT_INT4_BLOCK` for 0), or `PER_FEATURE`."""
    if mode != "int4":
        return PER_FEATURE
    return given or DEFAULT_INT4_BLOCK


def check(mode: str, lora_rank: int, given_block: int = 0) -> None:
    """One `error:` line where `model.quantize` cannot be used as given."""
    if given_block and not mode:
        raise UserError(f"model.quantize_block_size={given_block} sets int4's groups, and "
                        "model.quantize is not set: set model.quantize='int4', or drop it")
    if not mode:
        return
    if not isinstance(given_block, int) or (given_block < 1 and given_block != PER_FEATURE
                                            and given_block != 0):
        raise UserError(f"model.quantize_block_size={given_block!r} is not a block size; give a "
                        f"number of input features (64 or {DEFAULT_INT4_BLOCK}), or -1 for one "
                        "scale per output feature")
    if mode == "int8" and given_block not in (0, PER_FEATURE):
        raise UserError(f"model.quantize_block_size={given_block}: Keras 3.15's int8 has one "
                        "scale per output feature, no groups; drop model.quantize_block_size, "
                        "or quantize in groups with model.quantize='int4'")
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


def quantize_base(backbone, mode: str, targets: Sequence, block: int = PER_FEATURE) -> list:
    """Quantizes the projections of `backbone` its family names (`targets`: `lora.Target`s)
    to `mode`, weight-only (int4 in groups of `block` input features, or `PER_FEATURE`);
    returns the quantized layers."""
    done, layers = [], projections(backbone, targets)
    check_block(layers, block)
    for layer in layers:
        if _has_values(layer):
            _quantize(layer, mode, block)
        else:
            _quantized_shapes(layer, mode, block)
        done.append(layer)
    return done


def _quantize(layer, mode: str, block: int) -> None:
    """Keras's `layer.quantize` of the float kernel the layer holds, weight-only; an int4
    layer then computes with the toolkit's product (`_keep_the_kernel_packed`)."""
    shape = tuple(layer._kernel.shape)
    layer.quantize(mode, config=_weights_only(mode, block))
    if mode == "int4":
        _keep_the_kernel_packed(layer, shape)


class WhileLoading:
    """`model.quantize` applied as a transformers checkpoint is read (`hub_presets`): the
    backbone is made without values (`keras.StatelessScope`), each projection's float kernel
    never gets one, and each is quantized from the checkpoint's tensor in host memory, then
    placed as shards: the float model never exists, on the host or on the devices.

    Keras's own `layer.quantize` does the quantizing, on a float kernel of the variable's
    dtype as the loaded model would hold it: the same values as quantizing after loading.

    In a run of several processes (hosts) each projection is read by one of them (`reads`:
    the one that has read the fewest elements so far, so that none reads more than its share
    of the projections plus one tensor) and quantized there; its quantized variables reach
    the other hosts' devices as their shards (`host_placement.from_one_host`). The other
    weights (embeddings, norms, the head) every host reads."""

    def __init__(self, mode: str, targets: Sequence, block: int = PER_FEATURE):
        self.mode, self.targets, self.block = mode, targets, block
        self._pending, self._owners = {}, {}
        self._hosts, self._host, self._loads = 1, 0, [0]
        self.read_bytes = self.read_count = self.total_count = 0
        self.prepared = False  # whether a backbone was read this way (`prepare`)

    def prepare(self, backbone) -> None:
        """Takes the projections' kernels out of Keras's variables to initialise, and
        initialises the rest (within `host_placement.placed_from_host(loading=True)`: zeros,
        as shards, until loaded)."""
        import jax
        from keras.src.backend.common import global_state
        from keras.src.backend.common.variables import initialize_all_variables
        layers = projections(backbone, self.targets)
        check_block(layers, self.block)
        self._pending = {id(layer._kernel): layer for layer in layers}
        self._hosts, self._host = jax.process_count(), jax.process_index()
        self._loads = [0] * self._hosts
        waiting = global_state.get_global_attribute("uninitialized_variables", [])
        global_state.set_global_attribute(
            "uninitialized_variables", [v for v in waiting if id(v) not in self._pending])
        initialize_all_variables()
        self.prepared = True

    def takes(self, variable) -> bool:
        """Whether `variable` is a projection's float kernel, which `quantize` fills."""
        return id(variable) in self._pending

    def reads(self, variable) -> bool:
        """Whether this host reads the checkpoint's tensor of the projection `variable` (asked
        once per projection, in the same order on every host)."""
        owner = min(range(self._hosts), key=self._loads.__getitem__)
        self._loads[owner] += math.prod(variable.shape)
        self._owners[id(variable)] = owner
        self.total_count += 1
        return owner == self._host

    def quantize(self, variable, value) -> None:
        """Quantizes the checkpoint's `value` of the float kernel `variable` into its layer;
        `value` is None where another host reads it (`reads`)."""
        layer = self._pending.pop(id(variable))
        if value is not None:
            self.read_bytes += np.asarray(value).nbytes  # in the checkpoint's dtype
            self.read_count += 1
            value = np.asarray(value, dtype=variable.dtype)  # as the variable would have held it
        if self._hosts == 1:
            _drop_float_kernel(layer, value)
            _quantize(layer, self.mode, self.block)
            return
        owner = self._owners.pop(id(variable))
        caught = {}
        if value is not None:
            _drop_float_kernel(layer, value)
            with _assignments_caught(caught):
                _quantize(layer, self.mode, self.block)
        else:
            _quantized_shapes(layer, self.mode, self.block)
        from tpu_keras.parallelism import host_placement
        for name in _assigned(self.mode, self.block):
            quantized = getattr(layer, name)
            value = caught.pop(id(quantized)) if caught else None
            quantized.assign(host_placement.from_one_host(value, owner, quantized))
        assert not caught, f"{layer.path}: Keras assigned {len(caught)} variable(s) more"

    def unread(self) -> list[str]:
        """The projections the checkpoint held no tensor for."""
        return [layer.path for layer in self._pending.values()]

    def report(self) -> str:
        """What this host read of the projections, for the log."""
        read = f"{self.read_count} of {self.total_count} projections ({self.read_bytes:,} bytes)"
        if self._hosts == 1:
            return f"{self.mode} base: {read} quantized as they were read"
        return (f"{self.mode} base: host {self._host} of {self._hosts} read and quantized {read}; "
                "the other hosts' reached its devices as shards")


def _drop_float_kernel(layer, value) -> None:
    """The layer's float kernel (a variable never given a value) replaced by `value` in host
    memory, what Keras's quantize reads; None once another host reads it. Without Keras's
    `Layer.__delattr__`, which collects garbage for every variable it drops (0.3 s each
    with a large model in memory)."""
    layer._tracker.unlock()
    layer._untrack_variable(layer._kernel)
    object.__delattr__(layer, "_kernel")
    object.__setattr__(layer, "_kernel", value)
    layer._tracker.lock()


def _assigned(mode: str, block: int) -> tuple:
    """The variables Keras 3.15's `quantize` assigns, in order: the rest it initialises."""
    grouped = mode == "int4" and block != PER_FEATURE
    return ("_kernel", "kernel_scale") + (("kernel_zero",) if grouped else ())


@contextlib.contextmanager
def _assignments_caught(caught: dict):
    """Within: a value assigned to a variable named as a quantized kernel's are (`_assigned`)
    is kept in `caught` ({id(variable): value}), the variable left as it is; the rest (int4's
    group of each input feature, which every host computes) are assigned."""
    from keras.src.backend.jax import core
    assign = core.JaxVariable.assign
    names = {"kernel", "kernel_scale", "kernel_zero"}

    def catch(variable, value):
        if variable.name not in names:
            return assign(variable, value)
        caught[id(variable)] = np.asarray(value)

    core.JaxVariable.assign = catch
    try:
        yield
    finally:
        core.JaxVariable.assign = assign


def projections(backbone, targets: Sequence) -> list:
    """The layers of `backbone` that `targets` (`lora.Target`s) name: those `model.quantize`
    quantizes."""
    found = []
    for layer in backbone._flatten_layers(include_self=False):
        path = getattr(layer, "path", "") or ""
        if not any(target.block(path) is not None for target in targets):
            continue
        if type(layer) not in (keras.layers.Dense, keras.layers.EinsumDense):
            raise UserError(f"{path} is a {type(layer).__name__}; model.quantize quantizes Dense "
                            "and EinsumDense projections: use a float base for this model")
        found.append(layer)
    return found


def input_features(layer) -> int:
    """What a quantized kernel's rows are: the features each output feature sums over."""
    shape = tuple(layer._kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense):
        if not hasattr(layer, "_kernel_reduced_axes"):
            layer._set_quantization_info()
        return math.prod(shape[axis] for axis in layer._kernel_reduced_axes)
    return shape[0]


def check_block(layers: Sequence, block: int) -> None:
    """One `error:` line where int4's groups do not tile some layer's input features (Keras
    would leave a last, shorter group, which no other int4 format has)."""
    features = {layer.path: input_features(layer) for layer in layers}
    misfit = next((path for path, count in features.items()
                   if block != PER_FEATURE and count % block), None)
    if misfit is None:
        return
    fitting = [size for size in (256, 128, 64, 32, 16)
               if all(count % size == 0 for count in features.values())]
    suggestion = f"{fitting[0]}" if fitting else "-1 (one scale per output feature)"
    raise UserError(f"model.quantize_block_size={block} does not divide the {features[misfit]} "
                    f"input features of {misfit}; set model.quantize_block_size={suggestion}")


def _keep_the_kernel_packed(layer, shape: tuple) -> None:
    """The layer's int4 product, in place of Keras 3.15's `_int4_call`, whose backward pass
    keeps each layer's unpacked kernel (a byte per weight) from the forward pass until
    it is used: for a whole model that is a second base in memory (the 8B Llama of
    docs/fine_tuning.md: 16.6 GiB of the TPU compiler's temporaries on one v5e chip). Here
    the backward pass unpacks it again from the packed kernel."""
    import jax
    equation = layer.equation if isinstance(layer, keras.layers.EinsumDense) else None
    shape = tuple(layer.kernel.shape)  # the float kernel's
    block = getattr(layer, "_int4_block_size", None) or PER_FEATURE

    def dequantized(packed, scale, zero, dtype):
        columns = math.prod(shape[1:]) if equation is None else layer._int4_unpacked_column_size
        whole = keras.quantizers.unpack_int4(packed, columns, axis=-1, dtype="int8")
        if block == PER_FEATURE:
            return keras.ops.reshape(keras.ops.cast(whole, dtype) / keras.ops.cast(scale, dtype), shape)
        # Keras's grouped dequantization, (values - zero) * scale, group by group, in float32
        # as Keras computes it, then the compute dtype.
        groups = keras.ops.reshape(whole, (-1, block, columns))
        offset = keras.ops.cast(groups, "float32") - keras.ops.cast(zero, "float32")[:, None, :]
        values = keras.ops.reshape(offset * keras.ops.cast(scale, "float32")[:, None, :], shape)
        return keras.ops.cast(values, dtype)

    def product(x, kernel):
        return keras.ops.matmul(x, kernel) if equation is None else keras.ops.einsum(equation, x, kernel)

    def input_gradient(upstream, kernel):
        if equation is None:
            return keras.ops.matmul(upstream, keras.ops.transpose(kernel))
        return keras.ops.einsum(layer._custom_gradient_equation, upstream, kernel)

    @keras.ops.custom_gradient
    def int4_product(x, packed, scale, zero):
        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            # Unpacked again here, once the gradient has arrived. Without the barrier XLA merges
            # this unpacking with the forward pass's and keeps its result; JAX's own
            # rematerialisation keeps its recomputations apart the same way.
            again = jax.lax.optimization_barrier((packed, scale, zero, upstream))
            kernel = dequantized(*again[:3], upstream.dtype)
            return input_gradient(again[3], kernel), None, None, None
        return product(x, dequantized(packed, scale, zero, x.dtype)), grad

    def quantized_call(inputs, training=None):
        zero = layer.kernel_zero if block != PER_FEATURE else keras.ops.zeros((), "int8")
        outputs = int4_product(inputs, layer._kernel, layer.kernel_scale, zero)
        if layer.bias is not None:
            outputs = outputs + keras.ops.cast(layer.bias, outputs.dtype)
        return outputs if layer.activation is None else layer.activation(outputs)

    object.__setattr__(layer, "quantized_call", quantized_call)  # this layer's own


def rules(kernel_rules: Sequence[Rule], targets: Sequence, mode: str,
          block: int = PER_FEATURE) -> list[Rule]:
    """Layout rules of the quantized variables, from the float kernels' (`kernel_rules`).
    Per output feature, every scale whole (one float per output feature). int4 kernels
    Keras packs into a matrix, (input features, output features / 2), split as the float
    kernel's first input and first output axes are; in groups, the scales and zero points,
    (groups, output features), split alike, and the group of each input feature (`g_idx`)
    whole. A rule for one path in another rank is the Placer's to pick."""
    made = []
    grouped = mode == "int4" and block != PER_FEATURE
    for target in targets:
        matching = matching_rules(kernel_rules, target.kernel)
        axes = matching[0].axes if matching else ()
        matrix = ((axes[target.inputs[0]], axes[target.outputs(len(axes))[0]]) if len(axes) > 2
                  else tuple(axes))
        if grouped:
            made += [Rule(f"{target.pattern}/kernel_scale", matrix),
                     Rule(f"{target.pattern}/kernel_zero", matrix),
                     replicated(f"{target.pattern}/g_idx")]
        else:
            made.append(replicated(f"{target.pattern}/kernel_scale"))
        if mode == "int4" and len(axes) > 2:
            made.append(Rule(f"{target.pattern}/kernel", matrix))
    return made


def auxiliary(layer) -> list:
    """The quantized layer's variables besides its kernel (scales, zero points, groups):
    folded into the float kernel by `float_kernel`, absent from a float model."""
    return [getattr(layer, name) for name in ("kernel_scale", "kernel_zero", "g_idx")
            if hasattr(layer, name)]


def is_quantized(layer) -> bool:
    return getattr(layer, "quantization_mode", None) in MODES


def float_kernel(layer) -> np.ndarray:
    """The quantized layer's kernel dequantized (float32, the float kernel's shape): what the
    merged exports hold."""
    kernel = np.asarray(keras.ops.convert_to_numpy(layer.kernel), "float32")  # whole values
    scale = np.asarray(keras.ops.convert_to_numpy(layer.kernel_scale), "float32")
    block = getattr(layer, "_int4_block_size", None) or PER_FEATURE
    if layer.quantization_mode == "int4" and block != PER_FEATURE:  # (values - zero) * scale
        zero = np.asarray(keras.ops.convert_to_numpy(layer.kernel_zero), "float32")
        groups = kernel.reshape(scale.shape[0], block, scale.shape[1])
        return ((groups - zero[:, None, :]) * scale[:, None, :]).reshape(kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense):
        if layer.quantization_mode == "int4":  # one scale per column of the flattened kernel
            rows = math.prod(kernel.shape[axis] for axis in layer._kernel_reduced_axes)
            return (kernel.reshape(rows, -1) / scale).reshape(kernel.shape)
        scale = np.asarray(keras.ops.convert_to_numpy(layer._adjust_scale_for_dequant(scale)))
    return kernel / scale


def _weights_only(mode: str, block: int = PER_FEATURE):
    if mode == "int8":
        return keras.quantizers.Int8QuantizationConfig(activation_quantizer=None)
    return keras.quantizers.Int4QuantizationConfig(block_size=block)


def _has_values(layer) -> bool:
    """Whether the layer's kernel holds a value (not a model built for `plan` alone)."""
    return getattr(layer._kernel, "_value", True) is not None


def _quantized_shapes(layer, mode: str, block: int = PER_FEATURE) -> None:
    """What `layer.quantize` leaves behind, without the values: the quantized variables and
    the quantized dtype policy (`plan` compiles for their shapes; a host fills them with what
    another read, `WhileLoading`)."""
    config = _weights_only(mode, block)
    shape = tuple(layer._kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense):
        layer._set_quantization_info()
    _drop_float_kernel(layer, None)
    layer._tracker.unlock()
    layer.quantized_build(shape, mode, config)
    layer._tracker.lock()
    layer.quantization_config = config
    policy = "int8" if mode == "int8" else f"int4/{block}"
    layer.dtype_policy = keras.dtype_policies.get(f"{policy}_from_{layer.dtype_policy.name}")
    if mode == "int4":
        _keep_the_kernel_packed(layer, shape)
