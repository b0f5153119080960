"""The run's copy of its preset, all but the weights: its architecture and tokenizer
outlive `model.preset`.

A run's `config.json` names `model.preset`, a folder or handle that can
change or vanish after the run started (a shared folder someone updates,
an `hf://` handle whose upstream moves, a cleaned scratch disk). So the
chief copies the preset, all but its weights, into `DIR/model/` once the
model is built: keras-hub's config (or a transformers checkpoint's
`config.json`, which export reads too), the tokenizer's files and assets.
Once the run has a checkpoint, every later step (a resume, `evaluate`,
`export`, `generate`) builds the model from `DIR/model/` without weights
and restores the checkpoint into it, which holds every weight. A resume
with no checkpoint yet reads the weights from `model.preset` again, and
first checks that it still describes the kept model. So does every start
of a LoRA run whose checkpoints hold its adapters alone (`frozen_base`),
which also checks the base's weights against the run's record of them.

Presets inside the workdir (`{workdir}/base_preset`) are kept already,
and a model without a preset is all in `config.json`.
"""

# Imported inside functions: keras-hub (optional: absent on a plain install); TensorFlow
# (start-up time: not every caller needs it).
import json
import os

from tpu_keras import workdir as workdir_lib
from tpu_keras.errors import UserError
from tpu_keras.models import frozen_base, hub_presets

FOLDER = "model"


def folder(workdir: str) -> str:
    return os.path.join(workdir, FOLDER)


def keep(model_config, workdir: str) -> None:
    """The chief's copy of `model.preset`, all but its weights, into DIR/model (once): from
    the folder, or for a handle from where keras-hub put the files it downloaded."""
    import tensorflow as tf
    preset = model_config.get("preset", "")
    target = folder(workdir)
    if not preset or tf.io.gfile.exists(target) or workdir_lib.inside(preset, workdir) or hub_presets.is_kept(preset):
        return
    source = preset
    if hub_presets.is_handle(preset):  # downloaded by now: keras-hub's local copy of its files
        from keras_hub.src.utils.preset_utils import CONFIG_FILE, get_file
        source = os.path.dirname(get_file(preset, CONFIG_FILE))
    partial = f"{target}.partial"
    if tf.io.gfile.exists(partial):
        tf.io.gfile.rmtree(partial)
    for directory, _, names in tf.io.gfile.walk(source):
        relative = os.path.relpath(directory, source)
        for name in names:
            if name.endswith(frozen_base.WEIGHT_ENDINGS) or name == hub_presets.KEPT_MARKER:
                continue
            destination = os.path.normpath(os.path.join(partial, relative, name))
            tf.io.gfile.makedirs(os.path.dirname(destination))
            tf.io.gfile.copy(os.path.join(directory, name), destination, overwrite=True)
    with tf.io.gfile.GFile(os.path.join(partial, hub_presets.KEPT_MARKER), "w") as file:
        file.write(json.dumps({"source": preset}))
    tf.io.gfile.rename(partial, target, overwrite=True)


def use(preset: str, workdir: str, checkpointed: bool) -> str:
    """The `model.preset` a run in `workdir` builds from: DIR/model where the run kept its
    model and the weights come from a checkpoint, else `preset`. Where its weights come
    from `preset` again (no checkpoint yet, or checkpoints of LoRA adapters alone), first
    checks that `preset` still describes the kept model, and for adapters that its weights
    are those the run recorded (`frozen_base`)."""
    target = folder(workdir)
    recorded = frozen_base.read(workdir) if checkpointed else None
    if recorded is not None:
        preset = frozen_base.preset_of(preset, recorded)
        why = f"{workdir}'s checkpoints hold its LoRA adapters alone, so its base comes from"
    elif not preset or not hub_presets.is_kept(target):
        return preset  # nothing kept: no preset, one inside the workdir, or a run from before
    elif checkpointed:
        return target
    else:
        why = f"{workdir} has no checkpoint yet, so its weights come from"
    if hub_presets.is_kept(target):
        try:
            now = hub_presets.saved_backbone(preset)
        except UserError as error:
            raise UserError(f"{why} model.preset again, and {error}") from None
        if now != hub_presets.saved_backbone(target):
            held = f", and {workdir}'s checkpoints hold its LoRA adapters alone" if recorded else ""
            raise UserError(f"model.preset={preset!r} is not the model this run started with (kept "
                            f"in {target}){held}: put the original back, or start the new model in "
                            "another --workdir")
    if recorded is not None:
        frozen_base.check(preset, recorded, workdir)
    return preset
