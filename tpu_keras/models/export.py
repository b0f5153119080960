"""Models out: what a run leaves in DIR/export/ for other tools to load.

`export.formats` picks them (empty: every one that applies to the model):

- `saved_model`: the wrapped model as a TensorFlow SavedModel (DIR/export/);
- `keras_hub`: a keras-hub preset of the fine-tuned task with its tokenizer
  (DIR/export/keras_hub/; `keras_hub.models.<Task>.from_preset` loads it);
- `transformers`: keras-hub's transformers exporter (DIR/export/transformers/,
  for the families it knows: Llama 3, Gemma, Mistral, Qwen, GPT-2), or the
  family's own maps where keras-hub has none (Qwen 3, SmolLM3), tokenizer
  included;
- `lora`: a LoRA run's factors alone, in keras-hub's `save_lora_weights`
  format (DIR/export/lora.weights.h5; `models/lora_file.py`), for a run that
  adapted the query and value alone (what keras-hub's loader adapts); the two
  folders above hold the factors merged into the weights;
- `peft`: a LoRA run's factors as a PEFT adapter of the transformers model
  (DIR/export/peft/: `adapter_config.json`, `adapter_model.safetensors`;
  `models/peft_format.py`), for the families with a transformers exporter.
  Its `base_model_name_or_path` is the transformers checkpoint the run
  started from (`model.preset`; a `hf://` handle's name), which LoRA leaves
  unchanged; a run from anything else (a keras-hub preset, no preset, or
  `model.*` arguments that change the exported config) also writes that base,
  un-merged, in the transformers format (DIR/export/peft_base/), and names it.

The keras-hub formats are written from a host copy of the task: a fresh
task of the same config built in host memory (no distribution, the CPU
device), without LoRA, into which the run's weights are copied one variable
at a time, each to the weight of the same path (`weight_paths`; a weight
missing or shaped differently in the copy is a one-line error), an adapted
kernel with its LoRA update merged in (or left out, for PEFT's base).
The transformers folder is keras-hub's exporter, as the backbone's family
says (`models.families`: its exporter, its fix of keras-hub's).
A sharded weight goes from its devices to host memory shard by shard
(`numpy.asarray` of a jax array assembles the shards on the host), so no
device holds more than it did in training. keras-hub's save functions write local
files; they are written into a temporary folder and copied with
`tf.io.gfile`, so DIR may be on gs://.
"""

# Imported inside functions: JAX and keras-hub (optional: absent on a plain install; the tf
# engine runs without JAX); TensorFlow (start-up time: not every caller needs it).
import contextlib
import functools
import inspect
import json
import os
import shutil
import sys
import tempfile

from absl import logging
import keras
from keras.src.backend.common import global_state

from tpu_keras import workdir
from tpu_keras.errors import UserError, first_line
from tpu_keras.models import (expert_lora, families, hub, hub_presets, lora, lora_file, peft_format,
                              quantized, weight_paths)
from tpu_keras.models.hub import KERAS_HUB
from tpu_keras.models.hub_presets import complete_get_config

LORA_FILE = lora_file.FILE
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def formats(config, task=None) -> tuple[str, ...]:
    """The formats to write: `export.formats`, or every one that applies."""
    chosen = tuple(config.export.formats)
    if chosen:
        return chosen
    if not config.model.name.startswith(KERAS_HUB):
        return ("saved_model",)
    applies = ["saved_model", "keras_hub"]
    exporter = task is None or _has_transformers_exporter(task)
    if exporter:
        applies.append("transformers")
    adapted = lora.adapted_layers(task.backbone) if task is not None else []
    if adapted:
        settings = lora.settings_of(adapted)
        if lora_file.refusal(settings, task.backbone) is None:
            applies.append("lora")
        if exporter:
            applies.append("peft")
    return tuple(applies)


def write(model, config, export_dir: str, chosen=None) -> list[str]:
    """Writes the `chosen` formats (default: `formats(config)`) of the run's `model`
    into `export_dir`; returns a line for each format that could not be written
    for this model (the family the transformers exporter lacks), after writing the others."""
    task = find_task(model)
    chosen = formats(config, task) if chosen is None else chosen
    problems = []
    if "saved_model" in chosen:
        model.export(export_dir, verbose=False)
        logging.info("exported SavedModel to %s", export_dir)
    hub_formats = [name for name in chosen if name != "saved_model"]
    if not hub_formats:
        return problems
    if task is None:
        return [f"export.formats {hub_formats} are keras-hub formats, and {config.model.name!r} "
                "is not a keras-hub task; export it as 'saved_model'"]
    adapted = lora.adapted_layers(task.backbone)
    for name in ("lora", "peft"):
        if name in hub_formats and not adapted:
            problems.append(f"export format {name!r} needs a LoRA run (model.lora_rank), and "
                            f"{config.model.name!r} trained every weight; drop {name!r} from export.formats")
            hub_formats.remove(name)
    if "lora" in hub_formats and (refusal := lora_file.refusal(lora.settings_of(adapted), task.backbone)):
        problems.append(refusal)
        hub_formats.remove("lora")
    exporter_less = [name for name in ("transformers", "peft") if name in hub_formats]
    if exporter_less and not _has_transformers_exporter(task):
        problems.append(f"keras-hub has no transformers exporter for {type(task.backbone).__name__} "
                        f"({config.model.name}), which {' and '.join(map(repr, exporter_less))} "
                        "need; the other formats were written")
        hub_formats = [name for name in hub_formats if name not in exporter_less]
    if not hub_formats:
        return problems
    preset = config.model.get("preset", "")
    host = host_copy(task, preset) if set(hub_formats) & {"keras_hub", "transformers"} else None
    with tempfile.TemporaryDirectory() as local:
        if "keras_hub" in hub_formats:
            host.save_to_preset(os.path.join(local, "keras_hub"))
        if "transformers" in hub_formats:
            _write_transformers(host, os.path.join(local, "transformers"), preset, config)
        if "lora" in hub_formats:
            lora_file.write(task.backbone, os.path.join(local, LORA_FILE))
        if "peft" in hub_formats:
            problem = _write_peft(task, config, local, export_dir)
            if problem and "peft" in config.export.formats:
                problems.append(problem)
            elif problem:  # the default's: a family whose layers have no PEFT modules
                logging.warning("export: no peft adapter: %s", problem)
        for name in sorted(os.listdir(local)):
            copy(os.path.join(local, name), os.path.join(export_dir, name))
            logging.info("exported %s to %s", name, os.path.join(export_dir, name))
    return problems


def _write_transformers(host, folder: str, preset: str, config) -> None:
    """keras-hub's exporter of `host`'s family, the checkpoint's config.json kept."""
    tokenizer_cls = type(host.preprocessor.tokenizer) if host.preprocessor is not None else None
    with families.transformers_exporter(type(host.backbone), tokenizer_cls):
        host.export_to_transformers(folder)
    # keras-hub 0.32 renames a byte-pair vocabulary to transformers' name for the tokenizers
    # it lists alone (Qwen, Qwen 3.5, GPT-2); a family's own tokenizer exporter gets the same.
    vocabulary = os.path.join(folder, "vocabulary.json")
    if os.path.exists(vocabulary) and not os.path.exists(os.path.join(folder, "vocab.json")):
        os.rename(vocabulary, os.path.join(folder, "vocab.json"))
    _complete_config(folder, preset, host.backbone, _backbone_overrides(config))


def _write_peft(task, config, local: str, export_dir: str):
    """The PEFT adapter of the run's LoRA factors into `local`/peft (and, where the run
    started from no transformers checkpoint, the base into `local`/peft_base); a line
    saying why not where its LoRA layers have no PEFT modules, else None."""
    backbone = task.backbone
    try:
        peft_format.modules(backbone)
    except peft_format.Unsupported as reason:
        return (f"export format 'peft': {reason} ({type(backbone).__name__}); "
                "the other formats were written")
    preset = config.model.get("preset", "")
    base = _peft_base(preset, backbone, _backbone_overrides(config))
    write_base = base is None
    if write_base:
        base = os.path.join(export_dir, peft_format.BASE_FOLDER)
        base = base if workdir.is_remote(base) else os.path.abspath(base)
    peft_format.write(os.path.join(local, peft_format.FOLDER), backbone, base)
    if write_base:  # un-merged: the base weights alone
        _write_transformers(host_copy(task, preset, merged=False),
                            os.path.join(local, peft_format.BASE_FOLDER), preset, config)
    return None


def _peft_base(preset: str, backbone, overrides: dict):
    """The transformers checkpoint a LoRA run's adapter applies to: the one it started from
    (`model.preset`, or the source of the run's kept copy of it), as transformers and vLLM
    name it (`hf://org/name` is `org/name`); None where there is none (a keras-hub preset,
    no preset) or the run's `model.*` arguments changed what the exported config says."""
    if not preset or "{workdir}" in preset:
        return None
    source = hub_presets.kept_source(preset) if hub_presets.is_kept(preset) else preset
    try:
        if not hub_presets.is_transformers(preset):
            return None
        if overrides and _changed_keys(backbone, preset, overrides):
            return None
    except (UserError, ValueError, OSError):  # unreadable now: write the base
        return None
    if source.startswith("hf://"):
        return source[len("hf://"):]
    return source if hub_presets.is_handle(source) or workdir.is_remote(source) else os.path.abspath(source)


# Keys of the exporter's that describe the files it wrote, not the architecture.
_EXPORTER_KEYS = ("torch_dtype", "dtype", "transformers_version")


def _complete_config(folder: str, preset: str, backbone=None, overrides=None) -> None:
    """Where the run started from a transformers checkpoint of the same model_type, its
    config.json is the exported one's, the exporter's keys over it only where the run
    changed the architecture (`model.*` backbone arguments, `overrides`) or where they
    describe the files written (dtype). keras-hub 0.32's exporters write constants and
    defaults for what a backbone does not hold (Llama's and Mistral's max_position_embeddings,
    Mistral's head_dim as hidden_size / num_attention_heads) and leave out what its own loader
    and vLLM read (Qwen's `architectures` and sliding-window keys, Gemma's rms_norm_eps).
    The checkpoint's tokenizer files are kept too (fine-tuning leaves the tokenizer as it was)."""
    if not preset or "{workdir}" in preset:
        return
    if hub_presets.is_handle(preset) or not hub_presets.is_transformers(preset):
        return
    path = os.path.join(folder, "config.json")
    with open(path) as file:
        written = json.load(file)
    source = hub_presets.source_config(preset)
    if source.get("model_type") != written.get("model_type"):
        return
    changed = _changed_keys(backbone, preset, overrides) if overrides else set()
    kept = {key: value for key, value in source.items() if key not in _EXPORTER_KEYS
            and key not in changed}
    # The run's values inside the checkpoint's own groups too: transformers 5 writes rope_theta
    # and the rope scaling inside `rope_parameters`, which keras-hub's loader reads first.
    runs = {key: written[key] for key in changed}
    runs.update(item for key in changed if isinstance(written[key], dict) for item in written[key].items())
    kept = {key: {name: runs.get(name, inner) for name, inner in value.items()}
            if isinstance(value, dict) else value for key, value in kept.items()}
    replaced = sorted(key for key in kept if key in written and written[key] != kept[key])
    if replaced:
        logging.info("transformers export: the checkpoint's %s over keras-hub's exporter's",
                     ", ".join(f"{key}={kept[key]!r}" for key in replaced))
    with open(path, "w") as file:
        json.dump({**written, **kept}, file, indent=2)
    import tensorflow as tf  # the checkpoint may be on gs://
    for name in _TOKENIZER_FILES:  # Qwen's exporter writes vocab.json, its loader reads these
        if not os.path.exists(os.path.join(folder, name)) and tf.io.gfile.exists(os.path.join(preset, name)):
            tf.io.gfile.copy(os.path.join(preset, name), os.path.join(folder, name))


def _backbone_overrides(config) -> dict:
    """The run's `model.*` backbone arguments (over the preset's)."""
    return hub._backbone_kwargs(dict(config.model))


def _changed_keys(backbone, preset: str, overrides: dict) -> set:
    """The config keys that keras-hub's exporter writes otherwise for `backbone` than for the
    same backbone with the arguments in `overrides` set back to the checkpoint's: the keys the
    run changed. Every exporter reads the backbone's attributes, named as its arguments."""
    _, arguments = hub_presets.saved_backbone(preset)
    defaults = {name: parameter.default for name, parameter
                in inspect.signature(type(backbone).__init__).parameters.items()}
    original = {key: arguments.get(key, defaults.get(key)) for key in overrides}

    class AsCheckpoint:
        def __getattr__(self, name):
            return original[name] if name in original else getattr(backbone, name)

    exporter_config, _ = families.exporter(type(backbone))
    run, checkpoint = (json.loads(json.dumps(exporter_config(view), default=str))
                       for view in (backbone, AsCheckpoint()))
    return {key for key in run if run[key] != checkpoint.get(key)}


def find_task(model):
    """The keras-hub task inside the toolkit's wrapped model, or None for any other model."""
    keras_hub = sys.modules.get("keras_hub")
    if keras_hub is None:  # never imported, so no task was built: spare the 1-2 s import
        return None
    if isinstance(model, keras_hub.models.Task):
        return model
    return next((layer for layer in model._flatten_layers(include_self=False)
                 if isinstance(layer, keras_hub.models.Task)), None)


def host_copy(task, preset: str = "", merged: bool = True):
    """The same task in host memory with `task`'s weights, and the preset's preprocessor when
    it has a tokenizer. LoRA's factors are not in the copy: each adapted kernel holds its
    update merged in (`merged`), or its base alone (PEFT's base model). A quantized base
    (`model.quantize`) is dequantized, and a frozen bfloat16 one read into float32: the
    copy is a float model."""
    backbone = task.backbone
    # Made without running initialisers (jax would compile a random initialiser for each
    # shape, most of an export's time): each variable is assigned the run's value.
    # A quantized base (models.quantized): each kernel dequantized, its scales folded in.
    dequantized = {id(layer._kernel): layer for layer in backbone._flatten_layers(include_self=False)
                   if quantized.is_quantized(layer)}
    config = complete_get_config(backbone).get_config()
    if dequantized or lora.adapted_layers(backbone):
        policy = backbone.dtype_policy  # a quantized one's config holds each layer's policy
        # A LoRA run's frozen bfloat16 base (lora.base_policy): copied into float32 variables.
        config["dtype"] = lora.float_policy(getattr(policy, "default_policy", policy).name)
    with _on_host(), keras.StatelessScope(initialize_variables=False), \
            weight_paths.numbered_like(task):  # unnamed layers' paths as the run's
        host_backbone = complete_get_config(families.repaired(type(backbone).from_config(config)))
        task_config = {**task.get_config(), "backbone": host_backbone, "preprocessor": None,
                       "compile": False}
        host = type(task).from_config(task_config)
    scales = {id(v) for layer in dequantized.values() for v in quantized.auxiliary(layer)}
    sources = {path: weight for path, weight in weight_paths.weights(task).items()
               if not lora.is_factor(path) and id(weight) not in scales}
    targets = weight_paths.weights(host)
    shape = lambda w: tuple(dequantized[id(w)].kernel.shape) if id(w) in dequantized else w.shape
    detail = weight_paths.mismatch({k: shape(w) for k, w in sources.items()},
                                   {k: w.shape for k, w in targets.items()},
                                   there="the trained task", here="the copy")
    if detail:
        raise UserError(f"the keras-hub formats are written from a copy of {type(task).__name__} "
                        f"that keras-hub rebuilds from its config, and it differs: {detail}; "
                        "export the SavedModel alone (export.formats=['saved_model'])")
    updates = {id(layer._kernel): functools.partial(lora.delta, layer)
               for layer in lora.adapted_layers(backbone)} if merged else {}
    if merged:  # the experts' stacked weights (PEFT's target_parameters)
        updates.update(expert_lora.updates(backbone))
    with _on_host():
        for key, target in targets.items():  # by name: same-shaped weights cannot swap
            source = sources[key]
            if id(source) in dequantized:
                value = quantized.float_kernel(dequantized[id(source)])
            else:
                value = keras.ops.convert_to_numpy(source.value)  # shard by shard to host memory
            if id(source) in updates:
                value = value.astype("float32") + updates[id(source)]()
            value = value.astype(target.dtype, copy=False)  # a frozen bfloat16 base's: float32
            if target._value is None:  # made without its initialiser: the run's value is its first
                target._initialize_with_initializer(lambda shape, dtype, value=value: value)
                target._initializer = None
            else:
                target.assign(value)
        _initialize_the_rest()
    host.preprocessor = _preprocessor(type(task), preset)
    return host


def check_tokenizer(config) -> None:
    """Reads `model.preset`'s tokenizer, which the keras-hub formats carry, before a run trains,
    whatever tokenizer its data use: one that cannot be read is a one-line error at the start,
    not at the export once the run has trained (and kept the file in DIR/model). A preset
    without one is the export's warning."""
    preset = config.model.get("preset", "")
    carried = {"keras_hub", "transformers"} & set(formats(config))
    data_reads_it = config.data.get("tokens", {}).get("tokenizer") == "preset"  # read there already
    if not preset or not carried or hub_presets.is_handle(preset) or data_reads_it:
        return
    try:
        hub_presets.load_tokenizer(preset)
    except (ValueError, OSError, KeyError):  # none there, or none keras-hub takes: said at the export
        pass


def _preprocessor(task_cls, preset: str):
    """The preset's preprocessor (its tokenizer), or None where it has none; a one-line error
    where its tokenizer file cannot be read (`hub_presets.load_tokenizer`)."""
    if not preset or not getattr(task_cls, "preprocessor_cls", None):
        return None
    try:
        return hub_presets.load_tokenizer(preset, task_cls.preprocessor_cls)
    except (ValueError, FileNotFoundError, OSError, KeyError) as error:
        logging.warning("the exports carry no tokenizer: model.preset=%s has none that %s "
                        "reads (%s)", preset, task_cls.preprocessor_cls.__name__,
                        first_line(error, 120))
        return None


def _initialize_the_rest():
    """Variables made in `StatelessScope(initialize_variables=False)` wait for a value: those
    the copy did not assign (a seed generator's state) get their initialiser's now."""
    waiting = global_state.get_global_attribute("uninitialized_variables") or []
    global_state.set_global_attribute("uninitialized_variables", [])
    for variable in waiting:
        if variable._value is None:
            variable._deferred_initialize()


@contextlib.contextmanager
def _on_host():
    """Builds variables in host memory: no distribution, the CPU device."""
    if keras.backend.backend() == "jax":
        import jax
        previous = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            with jax.default_device(jax.devices("cpu")[0]):
                yield
        finally:
            keras.distribution.set_distribution(previous)
    else:
        import tensorflow as tf
        with tf.device("/cpu:0"):
            yield


def _has_transformers_exporter(task) -> bool:
    import keras_hub
    return (isinstance(task, keras_hub.models.CausalLM)
            and families.exporter(type(task.backbone)) is not None)


def copy(local: str, destination: str) -> None:
    """Copies a local file or folder to `destination` (local or gs://), replacing it."""
    import tensorflow as tf
    if tf.io.gfile.exists(destination):
        if tf.io.gfile.isdir(destination):
            tf.io.gfile.rmtree(destination)
        else:
            tf.io.gfile.remove(destination)
    if not workdir.is_remote(destination):
        os.makedirs(os.path.dirname(destination) or ".", exist_ok=True)
        (shutil.copytree if os.path.isdir(local) else shutil.copy)(local, destination)
        return
    if not os.path.isdir(local):
        tf.io.gfile.copy(local, destination, overwrite=True)
        return
    for folder, _, files in os.walk(local):
        relative = os.path.relpath(folder, local)
        target = destination if relative == "." else os.path.join(destination, relative)
        tf.io.gfile.makedirs(target)
        for name in files:
            tf.io.gfile.copy(os.path.join(folder, name), os.path.join(target, name), overwrite=True)
