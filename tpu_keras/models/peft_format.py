"""A LoRA run's factors as a PEFT adapter (DIR/export/peft/): what servers load.

`adapter_config.json` and `adapter_model.safetensors`, as PEFT's
`save_pretrained` writes them for a LoRA adapter of a transformers causal LM:
`peft.PeftModel.from_pretrained(base, DIR/export/peft)`, vLLM's
`--enable-lora --lora-modules name=DIR/export/peft`.

The toolkit's LoRA is PEFT's (`models.lora`), so the adapter is the run's
factors as they are: `r` is `model.lora_rank`, `lora_alpha` is
`model.lora_alpha`, `target_modules` the run's `model.lora_targets`, and each
module's `lora_A.weight` (r, in_features) and `lora_B.weight`
(out_features, r) are its factors reshaped (`lora.peft_matrices`). The
module names are the family's (`Family.lora_targets`): an adapted layer's
path gives its block number, its target the transformers module
(`model.layers.{i}.self_attn.q_proj`), named as keras-hub's transformers
exporter names that module's weight, which the transformers export and the
PEFT checks hold together.
"""

# Imported inside functions: safetensors (optional: absent on a plain install).
import json
import os

import numpy as np

from tpu_keras.models import expert_lora, lora

FOLDER = "peft"
BASE_FOLDER = "peft_base"  # the base model, in the transformers format, where none is named
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model


class Unsupported(Exception):
    """The backbone's LoRA layers have no transformers module names: the reason, one line."""


def modules(backbone) -> dict:
    """{transformers module name: adapted layer} of `backbone`'s LoRA layers."""
    found = {}
    for layer in lora.adapted_layers(backbone):
        target = layer._tpu_keras_lora.target
        if not target.transformers:
            raise Unsupported(f"the family names no transformers module for its {target.module!r}")
        found[target.transformers.replace("{i}", target.block(layer.path))] = layer
    return found


def tensors(found: dict, backbone=None) -> dict:
    """{safetensors key: array} of the modules `found` (`modules`), as PEFT names them, and of
    `backbone`'s adapted experts (`expert_lora`, PEFT's target_parameters)."""
    made = expert_lora.peft_tensors(backbone, _PREFIX) if backbone is not None else {}
    for name, layer in sorted(found.items()):
        lora_a, lora_b = lora.peft_matrices(layer)
        made[f"{_PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(lora_a)
        made[f"{_PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(lora_b)
    return made


def write(folder: str, backbone, base: str) -> dict:
    """Writes the adapter of `backbone`'s LoRA (its projections, `modules`, and its experts'
    stacked weights) into the local `folder`; returns its config."""
    from safetensors.numpy import save_file
    found = modules(backbone)
    settings = lora.settings_of(list(found.values()))
    alpha = settings.alpha
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": settings.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in found}),
        # the experts' stacked weights, in the order PEFT nests their wrappers (`expert_lora`)
        "target_parameters": expert_lora.parameters(backbone) or None,
        "base_model_name_or_path": base,
        "bias": "none",  # the adapted layers' biases are frozen (models/lora.py)
        "lora_dropout": 0.0,  # the toolkit's LoRA has none
        "fan_in_fan_out": False,  # lora_A (r, in_features), lora_B (out_features, r)
        "inference_mode": True,
        "use_rslora": settings.rslora,
        "modules_to_save": None,
    }
    os.makedirs(folder, exist_ok=True)
    save_file(tensors(found, backbone), os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(folder, CONFIG_FILE), "w") as file:
        json.dump(config, file, indent=2)
    return config
