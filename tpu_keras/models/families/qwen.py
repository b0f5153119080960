"""Qwen 2 and 2.5 (keras-hub's QwenBackbone): transformers' `qwen2`.

Its projections have Llama's paths (the query, key and value with a bias,
which LoRA leaves frozen, as PEFT's `bias="none"` does). Layout: keras-hub's
own `get_layout_map`; with `fsdp` every large weight is split besides.
"""

from tpu_keras.models.families import llama
from tpu_keras.models.families.family import Family, no_rope_scaling, register

FAMILY = register(Family(
    name="qwen",
    backbones=("QwenBackbone",),
    attention=("QwenAttention",),
    model_types=("qwen2",),
    read_config=no_rope_scaling,
    lora_targets=llama.LORA_TARGETS,
))
