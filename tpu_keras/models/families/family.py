"""The interface every model family file fills in (`Family`), the registry, and the lookups.

The package's `__init__` imports the families the toolkit ships; this module
imports none of them, so a family file imports it without a cycle.
"""

# Imported inside functions: keras-hub (optional: absent on a plain install).
import contextlib
import dataclasses
from typing import Callable, Optional

from tpu_keras.models.lora import Target
from tpu_keras.parallelism import Rule, Tie

class Unreadable(Exception):
    """A checkpoint's config.json asks for what the family's backbone cannot build: the reason."""


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    name: str                                         # 'llama'
    backbones: tuple[str, ...]                        # keras-hub backbone class names (their subclasses too)
    model_types: tuple[str, ...] = ()                 # transformers' config.json model_type
    # {config.json key: backbone argument}: what keras-hub's converter leaves out, passed through.
    converter_keys: dict = dataclasses.field(default_factory=dict)
    # {model_type: keras-hub's}: a model_type whose checkpoints keras-hub's converter for another
    # reads, and {the converter's weight-name prefix: the checkpoint's} for them (Qwen 3.5's
    # text model, which keras-hub 0.32's loader knows by its composite model_type alone).
    converter_model_types: dict = dataclasses.field(default_factory=dict)
    converter_prefixes: dict = dataclasses.field(default_factory=dict)
    # {key keras-hub's converter reads: the key transformers 5 writes in its place}: read where
    # the checkpoint has only the latter (Qwen3-MoE's `num_experts`, `num_local_experts`).
    config_aliases: dict = dataclasses.field(default_factory=dict)
    # config.json -> more backbone arguments; raises Unreadable for what the backbone cannot build.
    read_config: Optional[Callable[[dict], dict]] = None
    # (backbone, weights, config.json) -> None: the family's own reading of a checkpoint's
    # weights in place of keras-hub's converter's (gpt-oss: keras-hub 0.32 reads MXFP4 experts
    # alone); `weights` is keras-hub's safetensors loader (`port_weight`, `get_tensor`).
    convert_weights: Optional[Callable] = None
    # backbone -> None: mends what keras-hub builds wrong (weight paths), once it is built.
    repair: Optional[Callable] = None
    # The backbone's constructor arguments -> layout rules of its weights (None: keras-hub's
    # get_layout_map where the backbone has one, else every weight whole).
    layout: Optional[Callable[[dict], list[Rule]]] = None
    ties: tuple[Tie, ...] = ()                        # dimensions split alike (attention heads, MLP units)
    lora_targets: tuple[Target, ...] = ()             # the projections LoRA may adapt, PEFT's names
    lora_default: tuple[str, ...] = ("q_proj", "v_proj")  # PEFT's default target_modules for it
    # the experts' stacked weights LoRA may adapt (`expert_lora.ExpertTarget`s): PEFT's
    # target_parameters, where transformers keeps each block's experts as one parameter
    expert_targets: tuple = ()
    # Attention classes whose `_compute_attention(query, key, value, attention_mask, ...)` the
    # toolkit may restrict to one example of a packed row (`segments`); of them, those the
    # TPU's fused kernel serves (`splash_attention`).
    attention: tuple[str, ...] = ()
    fused_attention: tuple[str, ...] = ()
    # Linear-attention classes with keras-hub's Gated DeltaNet interface (Qwen 3.5's), whose
    # recurrent state and causal convolution the toolkit restarts at each example of a packed
    # row (`segments`, `gated_delta_net`).
    delta_nets: tuple[str, ...] = ()
    exporter: str = ""                                # keras-hub's transformers exporter, by backbone class ('': its own)
    # The family's own pieces of a transformers export, each in place of keras-hub's (where it
    # has none, or gets it wrong): backbone -> config.json; backbone -> {transformers name:
    # tensor}; tokenizer -> tokenizer_config.json.
    transformers_config: Optional[Callable] = None
    transformers_weights: Optional[Callable] = None
    transformers_tokenizer: Optional[Callable] = None
    tasks: tuple[type, ...] = ()                      # task classes keras_hub.models does not hold


_FAMILIES: list[Family] = []


def register(family: Family) -> Family:
    """Makes `family` known; a family registered later wins for the backbones it names."""
    _FAMILIES.append(family)
    return family


def known() -> list[Family]:
    """Every family, the latest registration of a name only."""
    latest = {family.name: family for family in _FAMILIES}
    return list(latest.values())


def of_backbone(backbone_cls) -> Optional[Family]:
    """The family of a backbone class (by its class or the nearest base class a family names)."""
    for cls in backbone_cls.__mro__:
        for family in reversed(_FAMILIES):
            if cls.__name__ in family.backbones:
                return family
    return None


def of_model_type(model_type: str) -> Optional[Family]:
    """The family that reads transformers checkpoints of `model_type`."""
    return next((f for f in reversed(_FAMILIES) if model_type in f.model_types), None)


def repaired(backbone):
    """`backbone`, mended by its family's `repair` where it has one."""
    family = of_backbone(type(backbone))
    if family is not None and family.repair is not None:
        family.repair(backbone)
    return backbone


def tasks() -> dict:
    """{name: task class} that families add to keras_hub.models."""
    return {task.__name__: task for family in _FAMILIES for task in family.tasks}


def refuse_first(checks) -> None:
    """Raises `Unreadable` with the reason of the first (wrong, reason) pair that is wrong."""
    reason = next((reason for wrong, reason in checks if wrong), None)
    if reason is not None:
        raise Unreadable(reason)


def unbuilt_llama_parts(config: dict, backbone: str, biases: bool = True) -> list:
    """(wrong, reason) pairs of what keras-hub's Llama-like backbones never build and their
    converters never read, for `refuse_first`: an MLP activation other than SiLU and, where
    `biases`, the projections' biases (`attention_bias`, `mlp_bias`)."""
    activation = config.get("hidden_act", "silu")
    checks = [(activation != "silu", f"hidden_act {activation!r}: {backbone}'s MLP is SiLU's")]
    if biases:
        checks.append((config.get("attention_bias") or config.get("mlp_bias"),
                       f"biases (attention_bias or mlp_bias): {backbone} has none"))
    return checks


def no_rope_scaling(config: dict) -> dict:
    """`read_config` of a family whose keras-hub converter reads no rope scaling at all."""
    kind = rope_type(config)
    if kind != "default":
        raise Unreadable(f"rope_type {kind!r}, which its converter does not read")
    return {}


def rope_type(config: dict) -> str:
    """The checkpoint's rope scaling type: transformers 5 writes `rope_parameters`, older
    checkpoints `rope_scaling`."""
    rope = rope_parameters(config)
    return rope.get("rope_type", rope.get("type", "default"))


def rope_parameters(config: dict) -> dict:
    return config.get("rope_scaling") or config.get("rope_parameters") or {}


def exporter(backbone_cls):
    """(config function, weights function) that write `backbone_cls` in the transformers
    format: keras-hub's exporter for `Family.exporter` (default: the class's own), each
    function replaced by the family's own where it has one; None where there is none."""
    from keras_hub.src.utils.transformers.export.hf_exporter import MODEL_CONFIGS, MODEL_EXPORTERS
    family = of_backbone(backbone_cls)
    source = family.exporter if family is not None and family.exporter else backbone_cls.__name__
    config = (family and family.transformers_config) or MODEL_CONFIGS.get(source)
    weights = (family and family.transformers_weights) or MODEL_EXPORTERS.get(source)
    return None if config is None or weights is None else (config, weights)


@contextlib.contextmanager
def transformers_exporter(backbone_cls, tokenizer_cls=None):
    """While open, keras-hub's `export_to_transformers`, which looks its tables up by the
    backbone's and the tokenizer's class names, writes `backbone_cls` with
    `exporter(backbone_cls)`, and a `tokenizer_cls` with the family's
    `transformers_tokenizer` where it has one."""
    from keras_hub.src.utils.transformers.export import hf_exporter
    family = of_backbone(backbone_cls)
    patches = [(hf_exporter.MODEL_CONFIGS, backbone_cls.__name__),
               (hf_exporter.MODEL_EXPORTERS, backbone_cls.__name__)]
    functions = list(exporter(backbone_cls) or (None, None))
    if tokenizer_cls is not None and family is not None and family.transformers_tokenizer:
        patches.append((hf_exporter.MODEL_TOKENIZER_CONFIGS, tokenizer_cls.__name__))
        functions.append(family.transformers_tokenizer)
    saved = [table.get(name) for table, name in patches]
    for (table, name), function in zip(patches, functions):
        if function is not None:
            table[name] = function
    try:
        yield
    finally:
        for (table, name), value in zip(patches, saved):
            if value is None:
                table.pop(name, None)
            else:
                table[name] = value
