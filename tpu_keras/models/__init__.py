"""Registered model builders (ours, and keras-hub tasks by name); `build(config.model)` makes one."""

from tpu_keras.models.registry import REGISTRY, build, register
from tpu_keras.models import gpt, hub, vision  # noqa: F401  (registers the builders)

__all__ = ["REGISTRY", "build", "register"]
