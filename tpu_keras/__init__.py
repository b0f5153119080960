"""tpu_keras: train Keras 3 models on a TPU pod, GPUs or a laptop CPU from one config.

The public surface is small and imported lazily, so that light entry points
(`python -m tpu_keras.launch`) start without importing TensorFlow.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "connect": "tpu_keras.cluster",
    "Cluster": "tpu_keras.cluster",
    "distributed_steps": "tpu_keras.steps",
    "UserError": "tpu_keras.errors",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in ("models", "data", "config", "engine", "layout", "mesh"):
        return importlib.import_module(f"tpu_keras.{name}")
    raise AttributeError(f"module 'tpu_keras' has no attribute {name!r}")


__all__ = sorted(_LAZY)
