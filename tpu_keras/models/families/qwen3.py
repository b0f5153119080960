"""Qwen 3 (keras-hub's Qwen3Backbone): transformers' `qwen3`, read from checkpoints only.

What the toolkit knows of it: keras-hub 0.32's converter reads no rope
scaling, so a checkpoint with one is refused rather than built without it.
"""

from tpu_keras.models.families.family import Family, no_rope_scaling, register

FAMILY = register(Family(
    name="qwen3",
    backbones=("Qwen3Backbone",),
    attention=("Qwen3Attention",),
    model_types=("qwen3",),
    read_config=no_rope_scaling,
))
