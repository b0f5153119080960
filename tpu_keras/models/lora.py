"""LoRA as PEFT defines it: one A (in_features x r) and one B (r x out_features) per projection.

A targeted projection computes `x W + scaling * (x A) B`, where
`scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA), before its
bias and activation, as PEFT computes it. A starts as PEFT starts it,
uniform in +-1/sqrt(in_features), and B at zero, so training starts from the
base model. Every other weight is frozen, the adapted layers' kernels and
biases too (PEFT's `bias="none"`). Under bfloat16 compute the frozen base is
stored in bfloat16 and the factors in float32 (`base_policy`).

The backward pass is written out (`_projection`): the factors' gradients
from the low-rank path, and the input's gradient in one product with the
merged kernel `W + scaling * A B`, formed there. Left to autodiff, the
input's gradient is the base's product plus the low-rank path's; with the
heads split over `model`, the base's is a partial sum per device, and the
TPU compiler then all-reduced each projection's apart (three activations
per layer for the query, key and value) instead of their sum once: the
8B Llama 3 LoRA of docs/fine_tuning.md sent 1.31 GiB per device and step on
a v5litepod-8 that way, and 0.88 GiB with the merged product, as with no
LoRA at all.

Why not Keras's `enable_lora`: on an `EinsumDense` kernel of shape
(in, heads, head_dim), keras-hub's query, key and value, Keras 3.15 keeps one
A per head, (in, heads, rank), and one B, (rank, head_dim). Its update then
has rank heads x rank and trains heads times PEFT's parameters at the same
rank, and a PEFT adapter that reproduces it needs r = heads x rank (512 for a
Llama 3 8B at rank 16, past what most servers load). Here a rank is PEFT's.

The factors live on the projection layer, as the weights `lora_a` and
`lora_b`, with the kernel's own axes: A has the kernel's input axes and r,
B has r and its output axes. keras-hub's query, (hidden, heads, head_dim),
has A (hidden, r) and B (r, heads, head_dim); its attention output,
(heads, head_dim, hidden), A (heads, head_dim, r) and B (r, hidden). So a
factor is split over the mesh along its kernel's axes (`factor_rules`), a
checkpoint keys it by path like any weight, and PEFT's matrices are its
reshapes: A (r, in_features) and B (out_features, r), the input and the
output axes each flattened in the kernel's order (`peft_matrices`).

Which projections a model has, under PEFT's names (`q_proj`, ...), is the
model family's knowledge (`models.families`, the `gpt` builder): a `Target`
each.
"""

import contextlib
import dataclasses
import math
import re
from typing import Sequence

import keras
import numpy as np

from tpu_keras.errors import UserError, closest
from tpu_keras.parallelism import Rule, Tie, matching_rules, replicated

# PEFT's LoraConfig default. A recipe that gives r alone means alpha 8 in PEFT, so it does here.
DEFAULT_ALPHA = 8.0
ALL_LINEAR = "all-linear"  # PEFT's word for every projection (the output head aside)
FACTORS = ("lora_a", "lora_b")
# The model.* keys of LoRA; the builders that offer it take all of them.
KEYS = ("lora_rank", "lora_alpha", "lora_targets", "lora_rslora")


@dataclasses.dataclass(frozen=True)
class Target:
    """A projection LoRA can adapt, under PEFT's name for it."""

    module: str                     # PEFT's name: 'q_proj'
    layer: str                      # the Keras layer's path, {i} the block: 'transformer_layer_{i}/self_attention/query'
    transformers: str = ""          # transformers' module path: 'model.layers.{i}.self_attn.q_proj'
    inputs: tuple[int, ...] = (0,)  # the kernel axes that index its input features

    @property
    def pattern(self) -> str:
        """A regex of the layer's paths, the block number its group."""
        return re.escape(self.layer).replace(re.escape("{i}"), r"(\d+)")

    @property
    def kernel(self) -> str:
        """The path of one such layer's kernel (block 0's), to look its layout rule up."""
        return self.layer.replace("{i}", "0") + "/kernel"

    def block(self, path: str):
        """The block number in a layer's `path` ('' for a target without blocks), or None
        where the path is not this target's."""
        match = re.search(rf"(^|/){self.pattern}$", path)
        if match is None:
            return None
        return match.group(2) if "{i}" in self.layer else ""

    def outputs(self, rank: int) -> tuple[int, ...]:
        return tuple(axis for axis in range(rank) if axis not in self.inputs)


@dataclasses.dataclass(frozen=True)
class Settings:
    """A run's LoRA: `model.lora_rank`, `lora_alpha`, `lora_targets` (PEFT's module names)
    and `lora_rslora`."""

    rank: int
    alpha: float
    modules: tuple[str, ...]
    rslora: bool = False
    parameters: tuple[str, ...] = ()  # PEFT's target_parameters: experts' stacked weights
    # PEFT's 'all-linear': every projection the model has (a family's targets that a size
    # lacks, Gemma 4's per-layer embeddings in its larger sizes, are no error)
    every_linear: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def settings(kwargs: dict, targets: Sequence[Target], default: Sequence[str], family: str):
    """The run's `Settings` from its `model.*` keys, checked against `targets` (the family's
    projections); None where `model.lora_rank` is 0."""
    rank = kwargs.get("lora_rank", 0) or 0
    if not isinstance(rank, int) or rank < 0:
        raise UserError(f"model.lora_rank={rank!r} must be a whole number, 0 (no LoRA) or more")
    if not rank:
        return None
    if not targets:
        raise UserError(f"model.lora_rank={rank}: the {family} family names no projections LoRA "
                        "can adapt; set model.lora_rank=0, or give the family LoRA targets "
                        "(docs/models.md#model-families)")
    alpha = kwargs.get("lora_alpha", DEFAULT_ALPHA)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise UserError(f"model.lora_alpha={alpha!r} must be a number above 0 (the update is scaled "
                        f"by lora_alpha / lora_rank; PEFT's default is {DEFAULT_ALPHA:g})")
    known = [target.module for target in targets]
    chosen = kwargs.get("lora_targets") or tuple(default)
    if isinstance(chosen, str):
        chosen = tuple(name.strip() for name in chosen.split(",") if name.strip())
    every_linear = tuple(chosen) == (ALL_LINEAR,)
    if every_linear:
        chosen = tuple(known)
    for name in chosen:
        if name not in known:
            raise UserError(f"model.lora_targets has {name!r}, which is not a projection of the "
                            f"{family} family{closest(str(name), known)}; choose from "
                            f"{', '.join(known)}, or '{ALL_LINEAR}'")
    rslora = kwargs.get("lora_rslora", False)
    if not isinstance(rslora, bool):
        raise UserError(f"model.lora_rslora={rslora!r} must be True or False")
    ordered = tuple(name for name in known if name in chosen)
    return Settings(rank, float(alpha), ordered, rslora, every_linear=every_linear)


# The policy of a LoRA run's frozen base where it computes in bfloat16 (`base_policy`).
FROZEN_BASE_POLICY = "bfloat16"


def base_policy(policy: str, rank) -> str:
    """The Keras dtype policy to build a run's base in (`policy`: the run's). Under LoRA with
    bfloat16 compute, every base weight is frozen and only ever read cast to bfloat16, so it
    is stored in bfloat16: half mixed_bfloat16's float32 copy, the same products. The
    factors stay float32 (`_adapt`), and so does the optimizer's state, theirs alone."""
    if rank and keras.dtype_policies.get(policy).compute_dtype == "bfloat16":
        return FROZEN_BASE_POLICY
    return policy


def float32_head(backbone) -> None:
    """Makes the output head of a base built in `base_policy`'s bfloat16 compute as under
    mixed_bfloat16: Keras's embeddings turn autocast off, so there the head's product read
    the float32 table and gave float32 logits. It now reads the bfloat16 table cast to
    float32 (`reverse_dtype`): the same logits from a bfloat16 checkpoint."""
    for layer in backbone._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.ReversibleEmbedding) and layer.reverse_dtype is None:
            layer.reverse_dtype = "float32"


def float_policy(policy: str) -> str:
    """The policy of a float copy of a base built in `policy`: mixed_bfloat16's float32
    variables for a frozen bfloat16 base, so that the exports merge LoRA's update into
    float32 kernels; any other base's own."""
    return "mixed_bfloat16" if policy == FROZEN_BASE_POLICY else policy


class Adapter:
    """One adapted layer's factors, its kernel's geometry and the switch that turns it off."""

    def __init__(self, layer, target: Target, settings: Settings):
        self.target, self.settings, self.on = target, settings, True
        mode = getattr(layer, "quantization_mode", None)
        if mode and mode not in ("int8", "int4"):
            raise UserError(f"{layer.path}: LoRA over a {mode} kernel is not supported; quantize "
                            "the base with model.quantize='int8' or 'int4'")
        shape = tuple(int(n) for n in layer.kernel.shape)  # a quantized kernel: its whole values
        self.inputs, self.outputs = _geometry(layer, len(shape))
        if self.inputs != tuple(target.inputs):
            raise UserError(f"{layer.path}: the family's LoRA target {target.module!r} says its "
                            f"kernel's input axes are {tuple(target.inputs)}, and the layer's "
                            f"kernel {list(shape)} reads its input on {self.inputs}; correct the "
                            "target's inputs")
        self.in_shape = tuple(shape[axis] for axis in self.inputs)
        self.out_shape = tuple(shape[axis] for axis in self.outputs)
        # A Dense layer's einsums follow its input's rank, known when it is called.
        self._einsums = _einsums(layer.equation) if isinstance(layer, keras.layers.EinsumDense) else None

    @property
    def in_features(self) -> int:
        return math.prod(self.in_shape)

    @property
    def out_features(self) -> int:
        return math.prod(self.out_shape)

    def einsums(self, inputs) -> "_Einsums":
        return self._einsums or _einsums(_dense_equation(len(inputs.shape)))

    def project(self, layer, inputs):
        """`inputs W + scaling * (inputs A) B` of a float kernel, in the inputs' dtype, with
        the backward pass written out (`_projection`)."""
        dtype = inputs.dtype
        kernel, a, b = (keras.ops.cast(v, dtype) for v in (layer.kernel, layer.lora_a, layer.lora_b))
        return _projection(self.einsums(inputs), self.settings.scaling)(inputs, kernel, a, b)

    def update(self, layer, inputs):
        """`scaling * (inputs A) B` alone, in the inputs' dtype: the part added to a quantized
        base's output (its kernel's input gradient is Keras's, from the dequantized kernel)."""
        e, dtype = self.einsums(inputs), inputs.dtype
        low = keras.ops.einsum(e.down, inputs, keras.ops.cast(layer.lora_a, dtype))
        return keras.ops.einsum(e.up, low, keras.ops.cast(layer.lora_b, dtype)) * keras.ops.cast(
            self.settings.scaling, dtype)


def attach(model, targets: Sequence[Target], settings: Settings) -> list:
    """Adapts the projections of `model` that `settings.modules` names; freezes every other
    weight. Returns the adapted layers."""
    for weight in model.weights:
        weight.trainable = False
    chosen = [target for target in targets if target.module in settings.modules]
    adapted = []
    for layer in model._flatten_layers(include_self=False):
        path = getattr(layer, "path", "") or ""
        target = next((t for t in chosen if t.block(path) is not None), None)
        if target is not None:
            _adapt(layer, target, settings)
            adapted.append(layer)
    found = {layer._tpu_keras_lora.target.module for layer in adapted}
    missing = [t.module for t in chosen if t.module not in found]
    if missing and not settings.every_linear:
        raise UserError(f"model.lora_targets {missing} match no layer of {model.name} (the family "
                        f"names them at {[t.layer for t in chosen if t.module in missing]}); "
                        "correct the family's targets, or leave them out of model.lora_targets")
    return adapted


def _adapt(layer, target: Target, settings: Settings) -> None:
    adapter = Adapter(layer, target, settings)
    bound = 1 / math.sqrt(adapter.in_features)  # PEFT's kaiming_uniform_(a=sqrt(5)) of A
    layer._tracker.unlock()
    layer.lora_a = layer.add_weight(
        name="lora_a", shape=adapter.in_shape + (settings.rank,), dtype="float32",
        initializer=keras.initializers.RandomUniform(-bound, bound))
    layer.lora_b = layer.add_weight(name="lora_b", shape=(settings.rank,) + adapter.out_shape,
                                    dtype="float32", initializer="zeros")
    layer._tracker.lock()
    object.__setattr__(layer, "_tpu_keras_lora", adapter)
    base_call = layer.call

    def call(inputs, *args, **kwargs):
        if not adapter.on:
            return base_call(inputs, *args, **kwargs)
        outputs = adapter.project(layer, inputs)  # the product, before the bias and activation
        if layer.bias is not None:
            outputs = outputs + keras.ops.cast(layer.bias, outputs.dtype)
        return outputs if layer.activation is None else layer.activation(outputs)

    object.__setattr__(layer, "call", call)  # this layer's: its class's call stays the base
    if getattr(layer, "quantization_mode", None):  # Keras calls `quantized_call` instead
        base_quantized_call = layer.quantized_call

        def quantized_call(inputs, *args, **kwargs):
            if not adapter.on:
                return base_quantized_call(inputs, *args, **kwargs)
            activation = layer.activation
            object.__setattr__(layer, "activation", None)  # Keras's product and bias alone
            try:
                outputs = base_quantized_call(inputs, *args, **kwargs)
            finally:
                object.__setattr__(layer, "activation", activation)
            outputs = outputs + keras.ops.cast(adapter.update(layer, inputs), outputs.dtype)
            return outputs if activation is None else activation(outputs)

        object.__setattr__(layer, "quantized_call", quantized_call)


def adapted_layers(model) -> list:
    """The projection layers of `model` that carry LoRA factors (`attach`); the experts'
    stacked weights are `expert_lora`'s."""
    return [layer for layer in model._flatten_layers(include_self=False)
            if isinstance(getattr(layer, "_tpu_keras_lora", None), Adapter)]


def settings_of(layers):
    """The `Settings` the adapted `layers` were attached with (one for a whole model)."""
    return layers[0]._tpu_keras_lora.settings


def is_factor(path: str) -> bool:
    """Whether the weight at `path` is a LoRA factor: a projection's (`lora_a`, `lora_b`) or a
    stacked expert weight's (`{name}_lora_a`, `{name}_lora_b`, `models.expert_lora`)."""
    return path.rsplit("/", 1)[-1].endswith(FACTORS)


@contextlib.contextmanager
def switched_off(layers):
    """Within the block, the adapted `layers` (projections, or experts: `expert_lora`) compute
    as their base alone (read when a call is traced): DPO's reference is the base model."""
    adapters = [layer._tpu_keras_lora for layer in layers]
    for adapter in adapters:
        adapter.on = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.on = True


def delta(layer) -> np.ndarray:
    """The adapted layer's update as a kernel: `scaling * A B`, laid out as its kernel."""
    adapter = layer._tpu_keras_lora
    a, b = peft_matrices(layer)  # (r, in_features), (out_features, r)
    merged = (b @ a).T.reshape(adapter.in_shape + adapter.out_shape) * adapter.settings.scaling
    return np.transpose(merged, np.argsort(adapter.inputs + adapter.outputs))


def peft_matrices(layer) -> tuple[np.ndarray, np.ndarray]:
    """(A (r, in_features), B (out_features, r)) of an adapted layer, as PEFT holds them
    (`lora_A.weight`, `lora_B.weight`), float32."""
    adapter = layer._tpu_keras_lora
    a = np.asarray(keras.ops.convert_to_numpy(layer.lora_a), "float32")
    b = np.asarray(keras.ops.convert_to_numpy(layer.lora_b), "float32")
    rank = adapter.settings.rank
    return a.reshape(adapter.in_features, rank).T, b.reshape(rank, adapter.out_features).T


def factor_rules(rules: Sequence[Rule], targets: Sequence[Target]) -> list[Rule]:
    """Layout rules of the `targets`' factors, from their kernels' rules: each factor is split
    along its kernel's axes (A over the input axes, B over the output axes); r stays whole."""
    made = []
    for target in targets:
        matching = matching_rules(rules, target.kernel)
        rule = matching[0] if matching else None
        if rule is None:
            continue  # no rule for the kernel: its factors are placed as it is (fsdp, or whole)
        if not rule.axes:
            made += [replicated(f"{target.pattern}/{name}") for name in FACTORS]
            continue
        outputs = target.outputs(len(rule.axes))
        made += [Rule(f"{target.pattern}/lora_a", tuple(rule.axes[a] for a in target.inputs) + (None,)),
                 Rule(f"{target.pattern}/lora_b", (None,) + tuple(rule.axes[a] for a in outputs))]
    return made


def factor_ties(ties: Sequence[Tie], targets: Sequence[Target]) -> list[Tie]:
    """`ties` with the targets' factors added: a factor's dimension is its kernel's."""
    made = []
    for tie in ties:
        members = list(tie.members)
        for pattern, dim in tie.members:
            for target in targets:
                if not re.fullmatch(pattern, target.kernel):
                    continue
                if dim in target.inputs:
                    members.append((f"{target.pattern}/lora_a", target.inputs.index(dim)))
                else:
                    members.append((f"{target.pattern}/lora_b",
                                    1 + dim - sum(axis < dim for axis in target.inputs)))
        made.append(Tie(tie.name, tuple(members)))
    return made


def _geometry(layer, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input axes, output axes) of the layer's kernel."""
    if isinstance(layer, keras.layers.EinsumDense):
        inputs, kernel, output = _split(layer.equation)
        ins = tuple(i for i, letter in enumerate(kernel) if letter in inputs)
        outs = tuple(i for i, letter in enumerate(kernel) if letter in output)
        if set(ins) & set(outs) or len(ins) + len(outs) != rank:
            raise UserError(f"{layer.path}: LoRA needs each kernel axis to index either the input "
                            f"or the output, and {layer.equation!r} does not")
        return ins, outs
    if isinstance(layer, keras.layers.Dense):
        return (0,), (1,)
    raise UserError(f"{layer.path} is a {type(layer).__name__}; LoRA adapts Dense and EinsumDense "
                    "layers")


@dataclasses.dataclass(frozen=True)
class _Einsums:
    """The einsums of `x W + scaling * (x A) B` and of its backward pass, for one kernel equation."""
    forward: str   # x, W -> y
    down: str      # x, A -> low
    up: str        # low, B -> y
    merge: str     # A, B -> W's shape
    inputs: str    # dy, W -> dx
    low: str       # dy, B -> dlow
    a: str         # x, dlow -> dA
    b: str         # low, dy -> dB


def _einsums(equation: str) -> _Einsums:
    inputs, kernel, output = _split(equation)
    z = next(c for c in "zyxwvutsrqponmlkjihgfedcba" if c not in equation)
    rest = "".join(c for c in inputs if c not in kernel)  # the batch and sequence letters
    ins = "".join(c for c in kernel if c in inputs)
    outs = "".join(c for c in kernel if c in output)
    return _Einsums(
        forward=f"{inputs},{kernel}->{output}", down=f"{inputs},{ins}{z}->{rest}{z}",
        up=f"{rest}{z},{z}{outs}->{output}", merge=f"{ins}{z},{z}{outs}->{kernel}",
        inputs=f"{output},{kernel}->{inputs}", low=f"{output},{z}{outs}->{rest}{z}",
        a=f"{inputs},{rest}{z}->{ins}{z}", b=f"{rest}{z},{output}->{z}{outs}")


def _dense_equation(rank: int) -> str:
    """A Dense layer's product as an einsum, for inputs of `rank` axes."""
    batch = "abcdefgh"[:rank - 1]
    return f"{batch}i,io->{batch}o"


def _projection(e: _Einsums, scaling: float):
    """(x, W, A, B) -> x W + scaling (x A) B, with the backward pass written out: dx in one
    product with the merged kernel (module docstring), dA and dB through the low rank."""

    @keras.ops.custom_gradient
    def projection(x, kernel, a, b):
        low = keras.ops.einsum(e.down, x, a)
        scale = keras.ops.cast(scaling, x.dtype)
        y = keras.ops.einsum(e.forward, x, kernel) + keras.ops.einsum(e.up, low, b) * scale

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            merged = kernel + keras.ops.einsum(e.merge, a, b) * scale
            d_low = keras.ops.einsum(e.low, upstream, b) * scale
            return (keras.ops.einsum(e.inputs, upstream, merged), None,
                    keras.ops.einsum(e.a, x, d_low),
                    keras.ops.einsum(e.b, low, upstream) * scale)
        return y, grad

    return projection


def _split(equation: str) -> tuple[str, str, str]:
    if "." in equation:
        raise UserError(f"LoRA does not adapt an EinsumDense with an ellipsis ({equation!r})")
    operands, output = equation.replace(" ", "").split("->")
    inputs, kernel = operands.split(",")
    return inputs, kernel, output
