"""Registered model builders (ours, and keras-hub tasks by name); `build(config.model)` makes one."""

from tpu_keras.models.registry import REGISTRY, build, register
from tpu_keras.models import gpt, hub, preset_copy, vision  # noqa: F401  (the builders register)

__all__ = ["REGISTRY", "build", "register"]
