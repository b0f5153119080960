"""keras-hub tasks as toolkit models: `model.name = "keras_hub:LlamaCausalLM"`.

The task's backbone comes from a preset (`model.preset`: a folder that
`save_to_preset` wrote, a transformers-format folder (config.json with
`model_type`, model.safetensors, tokenizer.json), local or on gs://, or a
handle such as `kaggle://...` or `hf://...`, which needs the network) or, to train from scratch, from the backbone's constructor
arguments given as `model.*` keys; with a preset those keys override its
config (`dropout=0.1`). A preset that another command writes (a run's
export) can say which, in `model.preset_written_by`: a run that finds no
preset there names that command to run first, `{workdir}` in it this run's
folder (`configs/grpo_stdlib.py`'s warm start). The task is then wrapped to
read what the toolkit's pipelines give and to return float32 logits:

- a causal LM (`...CausalLM`) takes token ids `(batch, model.context_length)`,
  the contract of the `gpt` builder, so data, metrics and
  `python -m tpu_keras.generate` work alike for both;
- an image classifier (`...ImageClassifier`) takes images, with
  `model.num_classes` outputs.

The backbone is built in `train.precision`'s dtype policy, passed
explicitly: `from_preset` replaces a preset's dtype with its `dtype`
argument even when that is None. A LoRA run's base under bfloat16 compute
is built in `bfloat16` (`lora.base_policy`): frozen, it needs no float32 copy;
the factors stay float32, and the head computes float32 logits as before.

Layout: the rules of the backbone's family (`models.families`), checked
like any builder's; for a family without rules of its own, or with
`model.layout_map='keras_hub'`, the backbone's own `get_layout_map`, checked
the same way (which is how its gaps show). `layout.extra_rules` adds to
either.

LoRA (`model.lora_rank`, `lora_alpha`, `lora_targets`, `lora_rslora`): PEFT's
LoRA (`models.lora`) on the projections the family names, attached once the
weights are loaded, under the run's distribution; every other weight is
frozen, and the optimizer holds state for the factors alone. The factors are
laid out along their kernels' axes.
"""

# Imported inside functions: keras-hub (optional: absent on a plain install); TensorFlow
# (start-up time: not every caller needs it).
import dataclasses
import functools
import inspect
import os
import re
import time

from absl import logging
import keras
import numpy as np

from tpu_keras import workdir as workdir_lib
from tpu_keras.errors import UserError, closest, first_line
from tpu_keras.models import (expert_lora, families, hub_presets, lora, moe, quantized, segments,
                              vocabulary_split)
from tpu_keras.models.metrics import bits_per_byte, bits_per_token_metric, token_mean_loss
from tpu_keras.models.registry import RESERVED, Builder, register_family
from tpu_keras.parallelism import host_placement, rules_from_layout_map

# model.* keys of the toolkit's, by kind of task; every other key is the backbone's.
_PRESET_KEYS = ("preset", "preset_written_by")
_TOOLKIT_KEYS = {
    "causal_lm": _PRESET_KEYS + lora.KEYS + (expert_lora.KEY, "quantize", "quantize_block_size", "layout_map",
                                             "context_length", "example_end_token",
                                             "moe_capacity_factor"),
    "image_classifier": _PRESET_KEYS + lora.KEYS + ("layout_map", "num_classes"),
}
_ANY_TOOLKIT_KEY = frozenset(key for keys in _TOOLKIT_KEYS.values() for key in keys)
LAYOUT_MAPS = ("toolkit", "keras_hub")
KERAS_HUB = "keras_hub:"  # the name prefix: model.name = "keras_hub:LlamaCausalLM"
WORKDIR_PLACEHOLDER = "{workdir}"  # model.preset = "{workdir}/base_preset": see expand_preset


def builder(task_name: str, kwargs: dict) -> Builder:
    """The toolkit `Builder` of keras-hub's task class `task_name` (say 'LlamaCausalLM')."""
    keras_hub = import_keras_hub()
    task_cls = _task_class(keras_hub, task_name)
    kind = _kind(keras_hub, task_cls)
    backbone_cls = task_cls.backbone_cls
    own = set(inspect.signature(backbone_cls.__init__).parameters) - {"self", "kwargs", "dtype"}
    arguments = _TOOLKIT_KEYS[kind] + tuple(sorted(own))
    lora_settings(backbone_cls, kwargs)  # a one-line error before anything is built
    quantized.check(kwargs.get("quantize", ""), kwargs.get("lora_rank", 0),
                    kwargs.get("quantize_block_size", 0))
    if kind == "causal_lm":
        vocabulary = backbone_config(backbone_cls, kwargs).get("vocabulary_size")
        metric, headline = ((bits_per_byte, "bits_per_byte") if vocabulary == 256
                            else (bits_per_token_metric, "bits_per_token"))
        tokens_per_example = lambda kw: kw.get("context_length", 128)
    else:
        metric = lambda: keras.metrics.SparseCategoricalAccuracy(name="accuracy")
        headline, tokens_per_example = "accuracy", lambda kw: 0
    return Builder(
        make=functools.partial(_make_in_base_policy, task_cls, kind),
        loss=token_mean_loss,
        metrics=lambda: [metric()], headline=headline, tokens_per_example=tokens_per_example,
        layout=functools.partial(_layout, backbone_cls),
        ties=functools.partial(_ties, backbone_cls), arguments=arguments)


def import_keras_hub():
    try:
        import keras_hub
    except ImportError:
        raise UserError("keras-hub models need the 'hub' extra: pip install -e \".[hub]\"") from None
    return keras_hub


def backbone_config(backbone_cls, kwargs: dict) -> dict:
    """The backbone's constructor arguments: its defaults, a local preset's (any format) over
    them, `kwargs` over both."""
    defaults, own = _defaults(backbone_cls), _backbone_kwargs(kwargs)
    preset = kwargs.get("preset", "")
    if preset and hub_presets.is_handle(preset) and "/" not in preset and preset not in backbone_cls.presets:
        raise UserError(f"model.preset={preset!r} is neither a folder nor one of keras-hub's "
                        f"{backbone_cls.__name__} presets{closest(preset, backbone_cls.presets)}; "
                        "give a folder's path, a handle such as 'hf://...', or a name from "
                        f"keras_hub.models.{backbone_cls.__name__}.presets")
    if preset and hub_presets.is_handle(preset):
        return own  # its config is known once it is downloaded, when the model is built
    if not preset or WORKDIR_PLACEHOLDER in preset:
        return {**defaults, **own}  # a preset the run writes (`prepare_preset`) is made from them
    _check_written(preset, kwargs.get("preset_written_by", ""))
    saved_cls, saved = hub_presets.saved_backbone(preset)
    if not issubclass(saved_cls, backbone_cls):
        task = saved_cls.__name__.replace("Backbone", "CausalLM")
        raise UserError(f"model.preset={preset!r} holds a {saved_cls.__name__}, not the "
                        f"{backbone_cls.__name__} that model.name needs; pick the matching task, "
                        f"such as model.name='{KERAS_HUB}{task}'")
    return {**defaults, **saved, **own}


def _check_written(preset: str, written_by: str) -> None:
    """A one-line error naming `model.preset_written_by`'s command when its preset is not
    there yet (without one, `hub_presets` names the missing folder alone)."""
    if not written_by or hub_presets.is_handle(preset):
        return
    import tensorflow as tf
    if not tf.io.gfile.exists(preset):
        raise UserError(f"model.preset={preset!r} does not exist yet; run `{written_by}` "
                        "first, which writes it (model.preset_written_by), or point model.preset "
                        "at another preset")


def _defaults(backbone_cls) -> dict:
    """The constructor's default arguments (Qwen3Backbone ties its head unless told not to)."""
    parameters = inspect.signature(backbone_cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _backbone_kwargs(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in _ANY_TOOLKIT_KEY and k not in RESERVED}


def lora_settings(backbone_cls, kwargs: dict):
    """The run's `lora.Settings` for a backbone of this class (None without LoRA), checked
    against its family's projections."""
    family = families.of_backbone(backbone_cls)
    name = family.name if family else backbone_cls.__name__
    settings = lora.settings(kwargs, family.lora_targets if family else (),
                             family.lora_default if family else (), name)
    if settings is None:
        if kwargs.get(expert_lora.KEY):
            raise UserError(f"model.{expert_lora.KEY}={kwargs[expert_lora.KEY]!r} adapts experts with "
                            "LoRA, and model.lora_rank is 0: set model.lora_rank (16, say), or drop it")
        return None
    return dataclasses.replace(settings, parameters=expert_lora.chosen(
        kwargs, family.expert_targets if family else (), name))


def _task_class(keras_hub, task_name):
    tasks = {name: value for name, value in vars(keras_hub.models).items()
             if isinstance(value, type) and issubclass(value, keras_hub.models.Task)
             and getattr(value, "backbone_cls", None) is not None}
    tasks.update(families.tasks())
    if task_name not in tasks:
        raise UserError(f"model.name='{KERAS_HUB}{task_name}' is not a keras-hub task"
                        f"{closest(task_name, tasks)}; use a class of keras_hub.models such as "
                        f"'{KERAS_HUB}LlamaCausalLM'")
    return tasks[task_name]


def _kind(keras_hub, task_cls) -> str:
    if issubclass(task_cls, keras_hub.models.CausalLM):
        return "causal_lm"
    if issubclass(task_cls, keras_hub.models.ImageClassifier):
        return "image_classifier"
    raise UserError(f"model.name='{KERAS_HUB}{task_cls.__name__}': the toolkit trains keras-hub "
                    "causal LMs ('...CausalLM') and image classifiers ('...ImageClassifier'); "
                    "build other tasks in your own code and give them tpu_keras.distributed_steps")


def _make_in_base_policy(task_cls, kind, **kwargs):
    """`_make` under Keras's global dtype policy set to the one the run's base is made in
    (`lora.base_policy`: bfloat16 for a LoRA run's frozen base under bfloat16 compute), not
    only given to the backbone: keras-hub 0.32's SmolLM3 layers take the global one."""
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(lora.base_policy(policy.name, kwargs.get("lora_rank", 0)))
    try:
        return _make(task_cls, kind, run_policy=policy.name, **kwargs)
    finally:
        keras.config.set_dtype_policy(policy)


def _make(task_cls, kind, preset="", preset_written_by="", lora_rank=0,
          lora_alpha=lora.DEFAULT_ALPHA, lora_targets=(), lora_rslora=False, lora_target_parameters=(),
          quantize="",
          quantize_block_size=0, layout_map="toolkit", context_length=128, example_end_token=-1,
          num_classes=10, run_policy="", moe_capacity_factor=None, **backbone_kwargs):
    """The wrapped task: a causal LM's token ids -> logits, a classifier's images -> logits.
    `run_policy`: the run's dtype policy, where the global one is the base's (`_make_in_base_policy`)."""
    del layout_map, preset_written_by  # the rules' business; the missing preset's hint
    dtype = keras.config.dtype_policy().name  # explicit: from_preset replaces the preset's
    backbone_cls = task_cls.backbone_cls
    if WORKDIR_PLACEHOLDER in preset:
        # A preset the run writes from these arguments (`prepare_preset`), not written yet:
        # `plan` builds the architecture it will hold.
        preset = ""
    targets = families.of_backbone(backbone_cls).lora_targets if quantize else ()
    block = quantized.block_size(quantize, quantize_block_size)
    # A transformers checkpoint's projections are quantized as they are read.
    quantizing = quantized.WhileLoading(quantize, targets, block) if quantize else None
    if preset:
        try:
            load = not hub_presets.is_kept(preset)  # a run's kept model: its checkpoint's weights
            with host_placement.placed_from_host(loading=load):  # no whole weight on one device
                backbone = hub_presets.load_backbone(backbone_cls, preset, dtype=dtype,
                                                     load_weights=load, quantizing=quantizing,
                                                     **backbone_kwargs)
        except (OSError, ValueError, ConnectionError) as error:
            if not hub_presets.is_handle(preset):
                raise
            raise UserError(f"model.preset={preset!r} could not be fetched ({first_line(error, 160)}); "
                            "a handle needs the network: where there is one, save the preset "
                            "with save_to_preset and set model.preset to that folder") from None
    else:
        _check_architecture_given(task_cls, backbone_cls, backbone_kwargs)
        backbone = families.repaired(backbone_cls(dtype=dtype, **backbone_kwargs))
    if run_policy and run_policy != dtype:  # a frozen bfloat16 base: the run's float32 logits
        lora.float32_head(backbone)
    adapted = lora_settings(backbone_cls, dict(lora_rank=lora_rank, lora_alpha=lora_alpha,
                                               lora_targets=lora_targets, lora_rslora=lora_rslora,
                                               lora_target_parameters=lora_target_parameters))
    if quantizing is not None and not quantizing.prepared:
        # A keras-hub preset's or a new model's base, quantized once its weights are in.
        with host_placement.placed_from_host():
            quantized.quantize_base(backbone, quantize, targets, block)
    if adapted:
        family = families.of_backbone(backbone_cls)
        lora.attach(backbone, family.lora_targets, adapted)
        if adapted.parameters:
            expert_lora.attach(backbone, family.expert_targets, adapted)
    _route_experts(backbone, moe_capacity_factor)
    name = task_cls.__name__.lower()
    if kind == "causal_lm":
        segments.route_delta_nets(backbone)  # Qwen 3.5's linear attention, in the toolkit's rule
        task = task_cls(backbone=backbone, preprocessor=None, compile=False)
        if backbone_kwargs:
            _check_runs(task, backbone_kwargs)
        tokens = keras.Input((context_length,), dtype="int32", name="tokens")
        if example_end_token >= 0:  # examples packed apart in a row (models.segments)
            if not segments.keep_examples_apart(backbone):
                raise UserError(f"{backbone_cls.__name__}'s attention cannot be kept to one example "
                                "of a packed row (its family names no attention class); pack "
                                "text as one stream (data.text.document_masks=False), or name the "
                                "family's attention (docs/models.md#model-families)")
            logits = segments.ExamplesApart(task, example_end_token, name="examples_apart")(tokens)
        else:
            logits = task(segments.task_inputs(task, tokens))
        logits = vocabulary_split.split(keras.ops.cast(logits, "float32"), task, (name, "examples_apart"))
        return keras.Model(tokens, logits, name=name)
    task = task_cls(backbone=backbone, num_classes=num_classes, preprocessor=None,
                    compile=False)
    images = keras.Input(backbone.input_shape[1:], name="images")
    return keras.Model(images, keras.ops.cast(task(images), "float32"), name=name)


def _check_architecture_given(task_cls, backbone_cls, backbone_kwargs):
    """A backbone built from arguments alone needs every one its constructor requires."""
    required = [name for name, parameter in inspect.signature(backbone_cls.__init__).parameters.items()
                if name != "self" and parameter.default is inspect.Parameter.empty
                and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)]
    missing = [name for name in required if name not in backbone_kwargs]
    if missing:
        raise UserError(f"model.name='{KERAS_HUB}{task_cls.__name__}' has no model.preset, so its "
                        f"{backbone_cls.__name__} is built from model.* alone, and "
                        f"{', '.join('model.' + name for name in missing)} are not set; set "
                        "model.preset to a checkpoint folder or handle, or give those")


def _check_runs(task, backbone_kwargs):
    """Traces the task on two tokens: keras-hub builds backbones from arguments that do not
    fit together (3 query heads over 2 key/value heads) and fails only when called with a
    known sequence length. Shapes only: nothing is computed or allocated (`plan` builds
    an 8B model this way)."""
    tokens = keras.KerasTensor((1, 2), "int32")
    try:
        # The layers' own calls, traced (a functional model's compute_output_spec reuses
        # the shapes it was built with, where the sequence length is unknown).
        keras.src.backend.compute_output_spec(task, segments.task_inputs(task, tokens))
    except Exception as error:  # pylint: disable=broad-except  # tf's OpError, jax's TypeError...
        given = ", ".join(f"model.{k}={v!r}" for k, v in sorted(backbone_kwargs.items()))
        reason = next((line for line in (_plain(l) for l in str(error).splitlines())
                       if line and not line.startswith("Exception encountered")),
                      type(error).__name__)
        raise UserError(f"keras-hub's {type(task.backbone).__name__} does not run with {given} "
                        f"({reason[:200]}); change those model.* values") from None


def _plain(line: str) -> str:
    """A line of an error message without Keras's terminal colour codes."""
    return re.sub(r"\x1b\[[0-9;]*m|\{\{[^}]*\}\}", "", line).strip()


_SAID = set()  # what this process has said once


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        logging.info("%s", line)


def _route_experts(backbone, capacity_factor) -> None:
    """A mixture of experts computed sparsely on jax (`models.moe`); said once per process on
    tf, which keeps keras-hub's dense expert bank."""
    blocks = moe.blocks(backbone)
    if capacity_factor is not None and not blocks:
        raise UserError(f"model.moe_capacity_factor={capacity_factor} applies to a mixture of "
                        f"experts, and {type(backbone).__name__} has none; drop it")
    if not blocks:
        return
    if keras.backend.backend() == "jax":
        routed = moe.route_blocks(backbone, capacity_factor)
        how = (f"each expert's slots for at most {capacity_factor}x an even share of copies, "
               "the rest dropped" if capacity_factor else "grouped matmuls, dropless")
        logging.info("experts: sparse in %d MoE layers (%s)", routed, how)
    else:
        moe.check_capacity(capacity_factor)
        _say_once("experts: keras-hub's dense expert bank on the tf engine (every expert on every "
                  "token); the jax engine computes them sparsely")


def _layout(backbone_cls, kwargs):
    """The family's rules (or keras-hub's map), and the rules of the LoRA factors it adapts."""
    config = backbone_config(backbone_cls, kwargs)
    choice = kwargs.get("layout_map", "toolkit")
    if choice not in LAYOUT_MAPS:
        raise UserError(f"model.layout_map={choice!r} is not one of {LAYOUT_MAPS}"
                        f"{closest(choice, LAYOUT_MAPS)}")
    family = families.of_backbone(backbone_cls)
    if choice == "toolkit" and family is not None and family.layout is not None:
        rules = family.layout(config)
    elif "get_layout_map" in dir(backbone_cls):
        # Keras only needs axis names from this mesh: one stand-in device builds on any backend.
        mesh = keras.distribution.DeviceMesh((1, 1), ["data", "model"], np.array([["cpu:0"]]))
        rules = rules_from_layout_map(backbone_cls.get_layout_map(
            mesh, model_parallel_dim_name="model", data_parallel_dim_name="data"))
    elif choice == "keras_hub":
        raise UserError(f"{backbone_cls.__name__} has no get_layout_map; drop "
                        "model.layout_map='keras_hub', or give layout.rules")
    else:
        return []  # replicated; on a mesh that splits weights, the Placer names what to cover
    made = (rules + lora.factor_rules(rules, _adapted_targets(backbone_cls, kwargs))
            + expert_lora.factor_rules(rules, _adapted_experts(backbone_cls, kwargs)))
    if kwargs.get("quantize"):
        made += quantized.rules(rules, family.lora_targets if family else (), kwargs["quantize"],
                                quantized.block_size(kwargs["quantize"],
                                                     kwargs.get("quantize_block_size", 0)))
    return made


def _ties(backbone_cls, kwargs) -> list:
    family = families.of_backbone(backbone_cls)
    ties = list(family.ties) if family is not None else []
    return lora.factor_ties(ties, _adapted_targets(backbone_cls, kwargs))


def _adapted_targets(backbone_cls, kwargs) -> list:
    settings = lora_settings(backbone_cls, kwargs)
    if settings is None:
        return []
    return [t for t in families.of_backbone(backbone_cls).lora_targets if t.module in settings.modules]


def _adapted_experts(backbone_cls, kwargs) -> list:
    settings = lora_settings(backbone_cls, kwargs)
    if settings is None:
        return []
    return [t for t in families.of_backbone(backbone_cls).expert_targets if t.module in settings.parameters]


def expand_preset(preset: str, workdir: str) -> str:
    """`model.preset` with `{workdir}` replaced by the run's folder: a preset the run writes
    itself (`prepare_preset`)."""
    return preset.replace(WORKDIR_PLACEHOLDER, workdir)


def expand_command(command: str, workdir: str) -> str:
    """`model.preset_written_by` with each `{workdir}...` path in it the run's folder's, its
    `..` resolved on a local disk (`--workdir={workdir}/../sft` -> `--workdir=/tmp/sft`)."""
    def expanded(match):
        path = workdir + match.group(1)
        return path if workdir_lib.is_remote(workdir) else os.path.normpath(path)
    return re.sub(re.escape(WORKDIR_PLACEHOLDER) + r"(\S*)", expanded, command)


def prepare_preset(model_config, workdir: str, is_chief: bool, wait_seconds: float = 300) -> None:
    """Writes the preset that a resolved `model.preset` names inside the run's folder (a
    `{workdir}` preset, `expand_preset`) when it does not exist yet: from the `model.*`
    backbone arguments, freshly initialised (seeded). Any other model is left as it is.

    That is the offline stand-in for a downloaded preset (configs/llama_stdlib.py:lora).
    The chief writes it into a temporary folder and renames it when complete; the other
    hosts wait for it, since each reads the same weights.
    """
    path = model_config.get("preset", "")
    if not path or not workdir_lib.inside(path, workdir) or hub_presets.is_kept(path):
        return
    import tensorflow as tf
    if tf.io.gfile.exists(os.path.join(path, "config.json")):
        return
    if is_chief:
        keras_hub = import_keras_hub()
        task_cls = _task_class(keras_hub, model_config.name[len(KERAS_HUB):])
        backbone = hub_presets.complete_get_config(
            task_cls.backbone_cls(dtype="float32", **_backbone_kwargs(dict(model_config))))
        partial = path + ".partial"
        if tf.io.gfile.exists(partial):
            tf.io.gfile.rmtree(partial)
        backbone.save_to_preset(partial)
        tf.io.gfile.rename(partial, path)
        logging.info("wrote a freshly initialised %s to %s as the preset to fine-tune",
                     type(backbone).__name__, path)
        return
    deadline = time.monotonic() + wait_seconds
    while not tf.io.gfile.exists(os.path.join(path, "config.json")):
        if time.monotonic() > deadline:
            raise UserError(f"the chief did not write the preset {path} within {wait_seconds:g} s; "
                            "check its log")
        time.sleep(1)


register_family(KERAS_HUB, builder, example=f"{KERAS_HUB}LlamaCausalLM")
