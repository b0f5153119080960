"""Qwen 2 and 2.5 (keras-hub's QwenBackbone): transformers' `qwen2`.

Its projections have Llama's paths (the query, key and value with a bias,
which LoRA leaves frozen, as PEFT's `bias="none"` does). Layout: keras-hub's
own `get_layout_map`; with `fsdp` every large weight is split besides.

keras-hub 0.32's QwenAttention applies a sliding window only where Keras has
no fused attention, and on jax (a CPU too) it always has; its window also
covers every layer where transformers' spares the first `max_window_layers`.
A checkpoint with `use_sliding_window` is refused (the released Qwen 2 and
2.5 have none).
"""

from tpu_keras.models.families import llama
from tpu_keras.models.families.family import (Family, no_rope_scaling, refuse_first, register,
                                              unbuilt_llama_parts)


def read_config(config: dict) -> dict:
    refuse_first([(config.get("use_sliding_window"), "use_sliding_window: keras-hub 0.32's "
                   "QwenAttention leaves its window out of the fused attention (the jax engine's)"),
                  *unbuilt_llama_parts(config, "QwenBackbone", biases=False)])  # q, k, v: read
    return no_rope_scaling(config)


FAMILY = register(Family(
    name="qwen",
    backbones=("QwenBackbone",),
    attention=("QwenAttention",),
    model_types=("qwen2",),
    read_config=read_config,
    lora_targets=llama.LORA_TARGETS,
))
