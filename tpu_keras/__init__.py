"""tpu_keras: train Keras 3 models on a TPU pod, GPUs or a laptop CPU from one config.

The packages, in the order a run meets them:

- `cluster`: find the hardware (`connect`), as a tf.distribute strategy or a jax mesh;
- `parallelism`: the mesh, layout rules, and the jax engine's distribution;
- `data`: tf.data pipelines, sharded per host and batched per replica;
- `models`: registered model builders, each with its layout rules;
- `training`: the run, its step functions, checkpoints, callbacks and guards;
- `measurement`: what a run measures of itself: model FLOPs, the peak, time per phase;
- `planning`: what a config needs on a TPU slice before it runs (`.plan`, `.layout`),
  checked against the TPU's own compiler;
- `tools`: the reports behind `python -m tpu_keras.info`, and the sampler.

From your own code: `connect` (the cluster and its mesh), `cluster.layout(rules)`
(your model's weights laid out and checked as a run's), `distributed_steps`
(fit under every strategy or mesh, with accumulation) and `plan_model` (the
memory and communication plan of your model on a TPU slice).

The public surface is small and imported lazily, so that light entry points
(`python -m tpu_keras.launch`) start without importing TensorFlow.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "connect": "tpu_keras.cluster",
    "Cluster": "tpu_keras.cluster",
    "distributed_steps": "tpu_keras.training",
    "plan_model": "tpu_keras.planning.user_plan",
    "UserError": "tpu_keras.errors",
}
_PACKAGES = ("cluster", "config", "data", "measurement", "models", "parallelism", "planning",
             "tools", "training")


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _PACKAGES:
        return importlib.import_module(f"tpu_keras.{name}")
    raise AttributeError(f"module 'tpu_keras' has no attribute {name!r}")


__all__ = sorted(_LAZY)
