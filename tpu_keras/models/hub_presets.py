"""What a preset holds, whatever its format, before the model is built.

`model.preset` may be a folder that keras-hub's `save_to_preset` wrote
(config.json with `class_name`) or a transformers-format folder (config.json
with `model_type`, model.safetensors, tokenizer.json), local or on gs://.
keras-hub's own preset loader tells the two apart, and its own converter
(`keras_hub.src.utils.transformers.convert_*`) maps a transformers config to
the backbone's arguments: the layout rules, the metrics and `plan` see the
same arguments the model is built with (`load_backbone`), and no second mapping
exists. Where keras-hub 0.32's converter leaves out a key of the config that
changes the model, the key is passed through here, as the checkpoint's
family says (`models.families`), in the one place both the arguments and the
built model come from.
"""

# Imported inside functions: keras-hub (optional: absent on a plain install); TensorFlow
# (start-up time: not every caller needs it).
import contextlib
import functools
import inspect
import io
import json
import os
import re

from absl import logging
import numpy as np

from tpu_keras import workdir
from tpu_keras.errors import UserError, first_line
from tpu_keras.models import families

# The weights of a transformers folder: one file, or an index of shards.
_TRANSFORMERS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


@functools.lru_cache(maxsize=None)
def saved_backbone(preset: str) -> tuple[type, dict]:
    """(backbone class, its constructor arguments) of the preset folder `preset`; a one-line
    error for a folder keras-hub cannot read. Read once per process (the registry asks often)."""
    loader = _loader(preset)
    backbone_cls = loader.check_backbone_class()
    converter = getattr(loader, "converter", None)
    if converter is None:  # keras-hub's own format: the saved constructor arguments
        return backbone_cls, dict(loader.config.get("config", {}))
    from keras_hub.src.utils.preset_utils import check_file_exists
    if not is_kept(preset) and not any(check_file_exists(preset, name)
                                            for name in _TRANSFORMERS_WEIGHTS):
        raise UserError(f"model.preset={preset!r} is a transformers checkpoint without weights "
                        f"(no {' or '.join(_TRANSFORMERS_WEIGHTS)}); save it with "
                        "save_pretrained(..., safe_serialization=True), or point at the folder "
                        "that holds them")
    return backbone_cls, {**_converted(loader, backbone_cls), **passed_through(preset)}


def _converted(loader, backbone_cls) -> dict:
    convert = loader.converter.convert_backbone_config  # as keras-hub's loader calls it
    try:
        if len(inspect.signature(convert).parameters) != 1:
            return dict(convert(loader.config, backbone_cls))
        return dict(convert(loader.config))
    except (KeyError, ValueError) as error:  # a key it needs is missing, a value it refuses
        what = f"no {error}" if isinstance(error, KeyError) else first_line(error, 160)
        raise UserError(f"model.preset={loader.preset!r}: keras-hub's converter cannot read its "
                        f"config.json ({what}); check the checkpoint's config.json") from None


@functools.lru_cache(maxsize=None)
def passed_through(preset: str) -> dict:
    """The backbone arguments that a transformers folder's config sets and keras-hub's
    converter leaves out, as the checkpoint's family says (`models.families`: its
    `converter_keys` and `read_config`; {} for a keras-hub preset); a one-line error for a
    config that the backbone cannot express (a rope scaling or head size keras-hub's layers
    lack)."""
    loader = _loader(preset)
    if getattr(loader, "converter", None) is None:
        return {}
    source = loader.config
    family = families.of_model_type(source.get("model_type"))
    if family is None:
        return {}
    converted = _converted(loader, loader.check_backbone_class())
    arguments = {argument: source[key] for key, argument in family.converter_keys.items()
                 if key in source and argument not in converted}
    try:  # what the family reads itself wins over the converter's reading
        arguments.update(family.read_config(source) if family.read_config else {})
    except families.Unreadable as reason:
        raise UserError(f"model.preset={preset!r}: {reason}; keras-hub 0.32's "
                        f"{loader.check_backbone_class().__name__} cannot build that model") from None
    return arguments


def load_backbone(backbone_cls, preset: str, load_weights: bool = True, quantizing=None, **kwargs):
    """`backbone_cls.from_preset(preset, load_weights, **kwargs)`; from a transformers folder,
    built from `saved_backbone`'s arguments (the keys keras-hub's converter leaves out passed
    through, `kwargs` over them) and given the checkpoint's weights in their own precision.

    `quantizing` (a `quantized.WhileLoading`): the projections quantized as they are read,
    from a transformers folder (its `prepared` says so); a keras-hub preset's weights are
    read whole, for the caller to quantize."""
    loader = _loader(preset)
    converter = getattr(loader, "converter", None)
    if converter is None:
        return families.repaired(backbone_cls.from_preset(preset, load_weights=load_weights, **kwargs))
    import keras
    from keras_hub.src.utils.preset_utils import jax_memory_cleanup
    quantizing = quantizing if load_weights else None
    # Without values where the projections are quantized as read: their float kernels never get one.
    with keras.StatelessScope(initialize_variables=False) if quantizing else contextlib.nullcontext():
        # keras-hub's TransformersPresetLoader.load_backbone builds cls(**{**converted, **kwargs}).
        backbone = families.repaired(backbone_cls.from_preset(preset, load_weights=False,
                                                              **{**passed_through(preset), **kwargs}))
    if load_weights:
        if quantizing:
            quantizing.prepare(backbone)
        jax_memory_cleanup(backbone)
        family = families.of_model_type(loader.config.get("model_type"))
        renamed = family is not None and loader.config["model_type"] in family.converter_model_types
        prefixes = family.converter_prefixes if renamed else {}
        # keras-hub 0.32's Qwen 3.5 converter prints an audit of the names it read; under the
        # text model's names it would list every weight as not read.
        quiet = contextlib.redirect_stdout(io.StringIO()) if prefixes else contextlib.nullcontext()
        convert = (family and family.convert_weights) or converter.convert_weights
        with _exact_safetensors(preset, prefixes, quantizing) as weights, quiet:
            convert(backbone, weights, loader.config)
            if quantizing:
                _check_all_read(preset, weights, quantizing)  # the files still open
                logging.info("%s", quantizing.report())
    return backbone


def _exact_safetensors(preset, prefixes=None, quantizing=None):
    """keras-hub's safetensors reader, whose converter hooks see arrays that keep their dtype:
    keras-hub 0.32's Mistral converter casts every weight to float16 as it loads it
    (`hf_tensor.astype(np.float16)`), which put a float32 checkpoint's logits 8e-3 from
    transformers'. `prefixes` ({the converter's: the checkpoint's}) rename what it asks for;
    `quantizing` (a `quantized.WhileLoading`) takes the projections' kernels."""
    from keras_hub.src.utils.transformers.safetensor_utils import SafetensorLoader

    import safetensors

    def written_as(hf_weight_key):
        for asked, written in (prefixes or {}).items():
            if hf_weight_key.startswith(asked):
                return written + hf_weight_key[len(asked):]
        return hf_weight_key

    class ExactSafetensors(SafetensorLoader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.read = set()  # the checkpoint's names read so far

        def get_tensor(self, hf_weight_key):
            hf_weight_key = written_as(hf_weight_key)
            try:
                tensor = super().get_tensor(hf_weight_key)
            except KeyError:
                raise UserError(f"model.preset={preset!r} holds no tensor {hf_weight_key}, which "
                                "keras-hub's converter reads for this model; point model.preset "
                                "at a complete checkpoint of it") from None
            except (safetensors.SafetensorError, OSError) as error:
                raise UserError(f"model.preset={preset!r}: a weight file cannot be read "
                                f"({first_line(error, 120)}); it is damaged or cut short: copy "
                                "it again from its source") from None
            self.read.add(hf_weight_key)
            return tensor

        def port_weight(self, keras_variable, hf_weight_key, hook_fn=None):
            if quantizing is not None and quantizing.takes(keras_variable):
                if not quantizing.reads(keras_variable):  # another host reads it
                    self.read.add(written_as(hf_weight_key))
                    quantizing.quantize(keras_variable, None)
                    return
            tensor = self.get_tensor(hf_weight_key)
            if hook_fn:
                tensor = hook_fn(tensor.view(_KeepsPrecision), list(keras_variable.shape))
            if quantizing is not None and quantizing.takes(keras_variable):
                quantizing.quantize(keras_variable, np.asarray(tensor))
            else:
                keras_variable.assign(np.asarray(tensor))

    return ExactSafetensors(preset)


# Tensors transformers writes that no model reads (older Llama checkpoints' rotary tables).
_NEVER_READ = ("rotary_emb.inv_freq",)


def _check_all_read(preset: str, weights, quantizing) -> None:
    """A base quantized while it loads reads every tensor of its checkpoint: one that keras-hub's
    converter never asked for is a weight of another model, which the quantized base would
    silently lack."""
    if quantizing.unread():
        raise UserError(f"model.preset={preset!r}: keras-hub's converter never filled "
                        f"{quantizing.unread()[0]}; point model.preset at a checkpoint of this model")
    if weights.safetensor_config is not None:
        names = set(weights.safetensor_config["weight_map"])
    else:
        names = {name for file in weights.safetensor_files.values() for name in file.keys()}
    unknown = sorted(name for name in names - weights.read if not name.endswith(_NEVER_READ))
    if unknown:
        raise UserError(f"model.preset={preset!r} holds {len(unknown)} tensor(s) this model does "
                        f"not have, such as {unknown[0]}; point model.preset at a checkpoint of "
                        "this model's architecture (its config.json describes another)")


class _KeepsPrecision(np.ndarray):
    """An array whose astype(float16) keeps its own, wider dtype."""

    def astype(self, dtype, *args, **kwargs):
        if np.dtype(dtype) == np.float16 and self.dtype.itemsize > 2:
            return self
        return super().astype(dtype, *args, **kwargs)


# Constructor arguments that keras-hub 0.32's get_config leaves out, by backbone class (and its
# subclasses): LlamaBackbone's (Llama 3's too) omits tie_word_embeddings, so a copy made from
# its config, or a preset save_to_preset wrote, was an untied model with one weight more.
_UNSAVED = {"LlamaBackbone": ("tie_word_embeddings",)}


def complete_get_config(backbone):
    """`backbone`, whose get_config (and so from_config copies and save_to_preset) now holds
    the arguments keras-hub's leaves out."""
    missing = [key for cls in type(backbone).__mro__ for key in _UNSAVED.get(cls.__name__, ())]
    if missing and not getattr(backbone, "_tpu_keras_complete_config", False):
        get_config = backbone.get_config

        def complete():
            return {**get_config(), **{key: getattr(backbone, key) for key in missing}}

        object.__setattr__(backbone, "get_config", complete)  # this instance's, not the class's
        object.__setattr__(backbone, "_tpu_keras_complete_config", True)
    return backbone


# The files keras-hub's converters read a transformers checkpoint's tokenizer from, by family
# (Gemma's SentencePiece tokenizer.model, Llama 3's and Qwen's byte-level BPE tokenizer.json, ...).
_TRANSFORMERS_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tekken.json", "vocab.json",
                                 "merges.txt", "spiece.model", "sentencepiece.bpe.model", "vocab.txt")


def load_tokenizer(preset: str, cls=None):
    """keras-hub's `cls.from_preset(preset)`: the preset's tokenizer (`cls` a tokenizer class,
    keras-hub's base class by default) or the preprocessor that holds it (`cls` a
    preprocessor class). A tokenizer file that the folder holds and keras-hub cannot read
    (garbage in tokenizer.model, a tokenizer.json cut short) is a one-line error naming it,
    whatever reads it: the data, or the export that carries it. A preset without a tokenizer
    (FileNotFoundError) or whose tokenizer `cls` does not take (ValueError) raises
    keras-hub's own error, for the caller to say what that means there."""
    if cls is None:
        import keras_hub
        cls = keras_hub.tokenizers.Tokenizer
    try:
        return cls.from_preset(preset)
    except FileNotFoundError as error:
        # keras-hub 0.32's Gemma 4 converter reads processor_config.json (its image and audio
        # processors) for the preprocessor, which a text-only checkpoint does not have.
        if "processor_config.json" not in str(error) or not hasattr(cls, "tokenizer_cls"):
            raise
        return cls(tokenizer=load_tokenizer(preset, cls.tokenizer_cls))
    except Exception as error:  # pylint: disable=broad-except  # SentencePiece's, json's, tf's
        if is_handle(preset) or not _unreadable(error):
            raise
        files = _tokenizer_files(preset, error)
        named = " or ".join(files) if files else "tokenizer files"
        reason = (f"no key {error}" if isinstance(error, KeyError) else
                  re.sub(r"\{\{[^}]*\}\}\s*", "", str(error)).replace(preset.rstrip("/") + "/", ""))
        raise UserError(f"model.preset={preset!r}: its {named} cannot be read as a tokenizer "
                        f"({first_line(reason, 160)}); replace {'it' if len(files) == 1 else 'them'} "
                        "with the checkpoint's own (an intact copy), or point model.preset at a "
                        "checkpoint whose tokenizer reads") from None


def _unreadable(error) -> bool:
    """Whether keras-hub's `error` says that a tokenizer file is there but cannot be read:
    SentencePiece's RuntimeError and TensorFlow's SentencePiece op error (a proto that does
    not parse), a file that is not JSON or not text, a JSON without the keys a tokenizer
    has, a path that is not a readable file. Not a missing file, nor a network's error."""
    import tensorflow as tf
    if isinstance(error, (FileNotFoundError, ConnectionError, tf.errors.NotFoundError)):
        return False
    return isinstance(error, (RuntimeError, tf.errors.OpError, json.JSONDecodeError,
                              UnicodeDecodeError, KeyError, OSError))


def _tokenizer_files(preset: str, error) -> list:
    """The preset's tokenizer files that `error` is about: those its message names, else
    those of its kind (the JSON files for an error of JSON or text, the others for the rest)."""
    import tensorflow as tf
    if is_transformers(preset):
        present = [name for name in _TRANSFORMERS_TOKENIZER_FILES
                   if tf.io.gfile.exists(os.path.join(preset, name))]
    else:  # keras-hub's own: the tokenizer's config and the assets it loads
        assets = os.path.join(preset, "assets", "tokenizer")
        present = ["tokenizer.json"] + [f"assets/tokenizer/{name}" for name in (
            sorted(tf.io.gfile.listdir(assets)) if tf.io.gfile.isdir(assets) else ())]
    named = [name for name in present if os.path.basename(name) in str(error)]
    textual = isinstance(error, (json.JSONDecodeError, UnicodeDecodeError, KeyError))
    return named or [name for name in present if name.endswith(".json") == textual] or present


def is_handle(preset: str) -> bool:
    """A keras-hub handle (downloaded), as opposed to a folder (local or on gs://)."""
    if preset.startswith(("kaggle://", "hf://", "modelscope://")):
        return True
    return not workdir.is_remote(preset) and "/" not in preset and not os.path.exists(preset)


# In a run's copy of its preset without the weights (models/preset_copy.py).
KEPT_MARKER = "kept.json"


def is_kept(preset: str) -> bool:
    """Whether `preset` is a run's kept model: a preset without weights, which come from
    the run's checkpoints."""
    import tensorflow as tf
    return bool(preset) and tf.io.gfile.exists(os.path.join(preset, KEPT_MARKER))


def kept_source(preset: str) -> str:
    """The `model.preset` a run's kept model (`is_kept`) was copied from: its folder or handle."""
    import tensorflow as tf
    with tf.io.gfile.GFile(os.path.join(preset, KEPT_MARKER)) as file:
        return json.load(file)["source"]


def is_transformers(preset: str) -> bool:
    """Whether the folder is in the transformers format (config.json with model_type)."""
    return getattr(_loader(preset), "converter", None) is not None


def source_config(preset: str) -> dict:
    """The preset's own config.json, as keras-hub's loader read it."""
    return dict(_loader(preset).config)


@functools.lru_cache(maxsize=None)
def _loader(preset: str):
    from keras_hub.src.utils.preset_utils import CONFIG_FILE, check_file_exists, get_preset_loader
    _read_other_model_types()
    try:
        found = check_file_exists(preset, CONFIG_FILE)
    except ValueError:  # keras-hub 0.32: "Unknown preset identifier" for a path that is not there
        raise UserError(f"model.preset={preset!r} does not exist; point it at a folder that "
                        "save_to_preset or transformers' save_pretrained wrote (config.json and "
                        "the weights), or at a keras-hub handle such as 'kaggle://...' or "
                        "'hf://...'") from None
    if not found:
        raise UserError(f"model.preset={preset!r} has no {CONFIG_FILE}; point it at a folder that "
                        "save_to_preset or transformers' save_pretrained wrote, or at a keras-hub "
                        "handle such as 'kaggle://...' or 'hf://...'")
    try:
        return get_preset_loader(preset)
    except json.JSONDecodeError as error:
        raise UserError(f"model.preset={preset!r}: its {CONFIG_FILE} is not JSON ({error}); "
                        "write the preset again, or point at an intact copy") from None
    except OSError as error:
        raise UserError(f"model.preset={preset!r} cannot be read ({first_line(error)}); check the "
                        "folder's permissions, or point at a readable copy") from None
    except ValueError as error:
        first = " ".join(str(error).split(". Create")[0].split())[:200].rstrip(".")
        raise UserError(f"model.preset={preset!r}: {first}; use a checkpoint of a family "
                        "keras-hub converts (llama, gemma, mistral, qwen2, qwen3, gpt2, ...), or "
                        "save the model with keras-hub's save_to_preset") from None


def _read_other_model_types() -> None:
    """Makes keras-hub's transformers loader (every `from_preset` of a transformers folder once
    the toolkit has read one) read a model_type that a family maps to another in
    `converter_model_types` with the other's converter, the config keeping its own model_type,
    and with the keys it reads under the names transformers 5 writes them (`config_aliases`).
    keras-hub 0.32 knows Qwen 3.5 as `qwen3_5` alone, the model with its vision tower; the
    text model transformers writes is `qwen3_5_text`. Once per process."""
    from keras_hub.src.utils.transformers.preset_loader import TransformersPresetLoader
    if getattr(TransformersPresetLoader, "_tpu_keras_other_model_types", False):
        return
    init = TransformersPresetLoader.__init__

    def read_as_its_converter(self, preset, config):
        family = families.of_model_type(config.get("model_type"))
        other = family.converter_model_types.get(config["model_type"]) if family else None
        aliases = family.config_aliases if family else {}
        config = {**{key: config[alias] for key, alias in aliases.items()
                     if key not in config and alias in config}, **config}
        init(self, preset, {**config, "model_type": other} if other else config)
        self.config = config

    TransformersPresetLoader.__init__ = read_as_its_converter
    TransformersPresetLoader._tpu_keras_other_model_types = True
