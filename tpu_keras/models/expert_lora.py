"""LoRA on a mixture of experts' stacked weights, as PEFT's `target_parameters` defines it.

PEFT adapts a parameter that holds every expert, (E, in, out) where
transformers multiplies `x @ W[e]` (gpt-oss's `mlp.experts.gate_up_proj` and
`down_proj`), with one `lora_A` (r * E, in) and one `lora_B` (out, r * E):
expert e's update is `scaling * A_e B_e`, A_e = rows e r .. e r + r - 1 of
`lora_A` transposed (in, r), B_e = columns r' E + e of `lora_B` (r, out) after
a transpose, so each expert has a LoRA of rank r of its own. `lora_A` starts
uniform in +-1/sqrt(in), `lora_B` at zero, as for a projection. PEFT's r is
`model.lora_rank` here too, and the scaling, alpha and rsLoRA are the run's.

The factors live on the experts' layer, beside their weight `{name}`:
`{name}_lora_a` (E, in, r) and `{name}_lora_b` (E, r, out), E first, so they
split over `expert` as the weight does (`factor_rules`). On the jax engine
the sparse layer (`models.moe`) multiplies each token by its expert's
`W + scaling * A B`, merged for the step as PEFT merges it
(`ParamWrapper`'s parametrization); the tf engine keeps keras-hub's dense
bank, which reads the weight alone, so such a run is refused there.

A family offers this where transformers keeps the experts as one parameter
(`Family.expert_targets`: PEFT's name, the Keras layer and weight, the
transformers module).
"""

import dataclasses
import functools
import math
import re
from typing import Sequence

import keras
import numpy as np

from tpu_keras.errors import UserError
from tpu_keras.models.lora import Settings, Target
from tpu_keras.parallelism import Rule, matching_rules

KEY = "lora_target_parameters"  # the model.* key: PEFT's target_parameters


@dataclasses.dataclass(frozen=True)
class ExpertTarget(Target):
    """A stacked expert weight LoRA can adapt: `module` PEFT's parameter name
    ('mlp.experts.gate_up_proj'), `layer` the Keras experts layer's path ({n}: the number
    Keras adds to an unnamed layer's name after the first, '_1'), `transformers` the
    transformers module holding it ('model.layers.{i}.mlp.experts'), `variable` the layer's
    weight's name, (E, in, out) (transformers' parameter holds the same, or its transpose:
    PEFT reads either by the true input features), `attribute` the layer's attribute holding
    it where that is not `variable`."""

    variable: str = ""
    attribute: str = ""

    @property
    def held(self) -> str:
        """The layer's attribute holding the weight."""
        return self.attribute or self.variable

    @property
    def pattern(self) -> str:
        return super().pattern.replace(re.escape("{n}"), r"(?:_\d+)?")

    @property
    def kernel(self) -> str:
        return f"{self.layer.replace('{i}', '0').replace('{n}', '')}/{self.variable}"


def chosen(kwargs: dict, targets: Sequence[ExpertTarget], family: str) -> tuple[str, ...]:
    """`model.lora_target_parameters` checked against the family's `targets`, in the family's
    order."""
    given = kwargs.get(KEY) or ()
    if isinstance(given, str):
        given = tuple(name.strip() for name in given.split(",") if name.strip())
    known = [target.module for target in targets]
    for name in given:
        if name not in known:
            where = (f"choose from {', '.join(known)}" if known else
                     f"the {family} family names no stacked expert weights (the toolkit adapts those "
                     "of gpt-oss, Qwen3-MoE and Qwen 3.5's MoE); drop it")
            raise UserError(f"model.{KEY} has {name!r}, which is not an expert weight LoRA can adapt; "
                            f"{where}")
    if given and keras.backend.backend() != "jax":
        raise UserError(f"model.{KEY} adapts the experts, which the tf engine computes with keras-hub's "
                        "dense bank, reading their weights alone: set --config.engine=jax, or drop it")
    return tuple(name for name in known if name in given)


class ExpertsAdapter:
    """The adapted weights of one experts layer (`{weight name: ExpertTarget}`) and the switch
    that turns them off (`lora.switched_off`)."""

    def __init__(self, settings: Settings):
        self.settings, self.targets, self.on = settings, {}, True


def attach(model, targets: Sequence[ExpertTarget], settings: Settings) -> list:
    """Adds the factors of the stacked weights `settings.parameters` names (after
    `lora.attach`, which froze every weight); returns the adapted layers."""
    picked = [target for target in targets if target.module in settings.parameters]
    adapted, found = [], set()
    for layer in model._flatten_layers(include_self=False):
        path = getattr(layer, "path", "") or ""
        for target in picked:
            if target.block(path) is None:
                continue
            _adapt(layer, target, settings)
            found.add(target.module)
            if layer not in adapted:
                adapted.append(layer)
    missing = [target.module for target in picked if target.module not in found]
    if missing:
        raise UserError(f"model.{KEY} {missing} match no layer of {model.name}; correct the family's "
                        "expert targets, or leave them out")
    return adapted


def _adapt(layer, target: ExpertTarget, settings: Settings) -> None:
    experts, inputs, outputs = (int(n) for n in getattr(layer, target.held).shape)
    adapter = getattr(layer, "_tpu_keras_lora", None) or ExpertsAdapter(settings)
    bound = 1 / math.sqrt(inputs)  # PEFT's kaiming_uniform_(a=sqrt(5)) of lora_A (r * E, in)
    layer._tracker.unlock()
    setattr(layer, f"{target.held}_lora_a", layer.add_weight(
        name=f"{target.variable}_lora_a", shape=(experts, inputs, settings.rank), dtype="float32",
        initializer=keras.initializers.RandomUniform(-bound, bound)))
    setattr(layer, f"{target.held}_lora_b", layer.add_weight(
        name=f"{target.variable}_lora_b", shape=(experts, settings.rank, outputs), dtype="float32",
        initializer="zeros"))
    layer._tracker.lock()
    adapter.targets[target.held] = target
    object.__setattr__(layer, "_tpu_keras_lora", adapter)


def adapted_layers(model) -> list:
    """The experts layers of `model` that carry factors (`attach`)."""
    return [layer for layer in model._flatten_layers(include_self=False)
            if isinstance(getattr(layer, "_tpu_keras_lora", None), ExpertsAdapter)]


def is_factor(path: str) -> bool:
    return re.search(r"_lora_[ab]$", path) is not None


def weight(layer, name: str):
    """The layer's stacked weight (its attribute `name`) as the step multiplies by it: with its
    update merged in where it is adapted and switched on, in the weight's own dtype."""
    value = keras.ops.convert_to_tensor(getattr(layer, name))
    adapter = getattr(layer, "_tpu_keras_lora", None)
    if not isinstance(adapter, ExpertsAdapter) or name not in adapter.targets or not adapter.on:
        return value
    a, b = (getattr(layer, f"{name}_lora_{factor}") for factor in "ab")
    update = keras.ops.einsum("eir,ero->eio", a, b) * adapter.settings.scaling
    return keras.ops.cast(keras.ops.cast(value, "float32") + update, value.dtype)


def updates(model) -> dict:
    """{id(stacked weight): a function of no arguments giving its update} of `model`'s adapted
    experts: what a merged export adds, one weight at a time (`update`)."""
    return {id(getattr(layer, name)): functools.partial(update, layer, name)
            for layer in adapted_layers(model) for name in layer._tpu_keras_lora.targets}


def update(layer, name: str) -> np.ndarray:
    """The adapted weight `name`'s update, scaling * A B (float32, the weight's shape)."""
    a, b = _factors(layer, name)
    return np.einsum("eir,ero->eio", a, b) * layer._tpu_keras_lora.settings.scaling


def _factors(layer, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(A (E, in, r), B (E, r, out)) of the adapted weight `name`, float32 in host memory."""
    return tuple(np.asarray(keras.ops.convert_to_numpy(getattr(layer, f"{name}_lora_{factor}")), "float32")
                 for factor in "ab")


def peft_tensors(model, prefix: str) -> dict:
    """{PEFT's safetensors key: array} of `model`'s adapted experts: `lora_A.weight` (r * E, in)
    and `lora_B.weight` (out, r * E) per weight. PEFT nests the wrappers of one module's
    weights in `target_parameters`' order, the first innermost (`base_layer.` once per
    wrapper around it)."""
    made = {}
    for layer in adapted_layers(model):
        names = list(layer._tpu_keras_lora.targets)
        for position, name in enumerate(names):
            target = layer._tpu_keras_lora.targets[name]
            module = target.transformers.replace("{i}", target.block(layer.path))
            key = f"{prefix}{module}." + "base_layer." * (len(names) - 1 - position)
            a, b = _factors(layer, name)
            experts, inputs, rank = a.shape
            made[f"{key}lora_A.weight"] = np.ascontiguousarray(
                a.transpose(0, 2, 1).reshape(experts * rank, inputs))
            made[f"{key}lora_B.weight"] = np.ascontiguousarray(
                b.transpose(2, 1, 0).reshape(b.shape[-1], rank * experts))
    return made


def parameters(model) -> list[str]:
    """PEFT's `target_parameters` of `model`'s adapted experts, in the family's order."""
    names = []
    for layer in adapted_layers(model):
        names += [t.module for t in layer._tpu_keras_lora.targets.values() if t.module not in names]
    return names


def factor_rules(rules: Sequence[Rule], targets: Sequence[ExpertTarget]) -> list[Rule]:
    """Layout rules of the `targets`' factors from their weights' rules: A (E, in, r) split
    as the weight's experts and inputs, B (E, r, out) as its experts and outputs."""
    made = []
    for target in targets:
        matching = matching_rules(rules, target.kernel)
        if not matching or not matching[0].axes:
            continue
        experts, inputs, outputs = matching[0].axes
        name = f"{target.pattern}/{target.variable}"
        made += [Rule(f"{name}_lora_a", (experts, inputs, None)),
                 Rule(f"{name}_lora_b", (experts, None, outputs))]
    return made
