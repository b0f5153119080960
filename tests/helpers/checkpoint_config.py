"""A run of one transformers checkpoint, its architecture the checkpoint's alone.

    --config=tests/helpers/checkpoint_config.py:Qwen3CausalLM --config.model.preset=FOLDER
"""

from tpu_keras.config import defaults


def get_config(task="LlamaCausalLM"):
    config = defaults()
    config.engine = "jax"
    config.data.tfds.name = "stdlib_bytes/ctx64"
    config.data.preprocess = "next_token"
    config.model = dict(name=f"keras_hub:{task}", preset="", context_length=64)
    return config
