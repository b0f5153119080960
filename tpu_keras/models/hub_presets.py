"""What a preset holds, whatever its format, before the model is built.

`model.preset` may be a folder that keras-hub's `save_to_preset` wrote
(config.json with `class_name`) or a transformers-format folder (config.json
with `model_type`, model.safetensors, tokenizer.json), local or on gs://.
keras-hub's own preset loader tells the two apart, and its own converter
(`keras_hub.src.utils.transformers.convert_*`) maps a transformers config to
the backbone's arguments: the layout rules, the metrics and `plan` see the
same arguments `from_preset` will build with, and no second mapping exists.
"""

import functools
import inspect
import json
import os

from tpu_keras.errors import UserError, first_line

# The weights of a transformers folder: one file, or an index of shards.
_TRANSFORMERS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


@functools.lru_cache(maxsize=None)
def describe(preset: str) -> tuple[type, dict]:
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
    convert = converter.convert_backbone_config  # as keras-hub's loader calls it
    if len(inspect.signature(convert).parameters) != 1:
        return backbone_cls, dict(convert(loader.config, backbone_cls))
    return backbone_cls, dict(convert(loader.config))


def is_handle(preset: str) -> bool:
    """A keras-hub handle (downloaded), as opposed to a folder (local or on gs://)."""
    if preset.startswith(("kaggle://", "hf://", "modelscope://")):
        return True
    return "://" not in preset and "/" not in preset and not os.path.exists(preset)


# In a run's copy of its preset without the weights (models/kept.py).
KEPT_MARKER = "kept.json"


def is_kept(preset: str) -> bool:
    """Whether `preset` is a run's kept model: a preset without weights, which come from
    the run's checkpoints."""
    import tensorflow as tf
    return bool(preset) and tf.io.gfile.exists(os.path.join(preset, KEPT_MARKER))


def is_transformers(preset: str) -> bool:
    """Whether the folder is in the transformers format (config.json with model_type)."""
    return getattr(_loader(preset), "converter", None) is not None


def source_config(preset: str) -> dict:
    """The preset's own config.json, as keras-hub's loader read it."""
    return dict(_loader(preset).config)


@functools.lru_cache(maxsize=None)
def _loader(preset: str):
    from keras_hub.src.utils.preset_utils import CONFIG_FILE, check_file_exists, get_preset_loader
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
