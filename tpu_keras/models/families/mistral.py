"""Mistral (keras-hub's MistralBackbone): transformers' `mistral`.

Its weights have Llama's paths, so it takes Llama's layout rules, ties and
LoRA targets. keras-hub 0.32's Mistral converter casts every weight to
float16 as it loads it; `hub_presets` reads every family's checkpoint in its
own precision instead.
"""

from tpu_keras.models.families import llama
from tpu_keras.models.families.family import (Family, no_rope_scaling, refuse_first, register,
                                              unbuilt_llama_parts)


def read_config(config: dict) -> dict:
    refuse_first(unbuilt_llama_parts(config, "MistralBackbone"))
    return no_rope_scaling(config)


FAMILY = register(Family(
    name="mistral",
    backbones=("MistralBackbone",),
    attention=("CachedMistralAttention",),
    model_types=("mistral",),
    read_config=read_config,
    layout=llama.layout,
    ties=llama.TIES,
    lora_targets=llama.LORA_TARGETS,
))
