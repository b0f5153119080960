"""Registered model builders; `build(config.model, strategy)` makes one in scope."""

from tpu_keras.models.registry import REGISTRY, build, register
from tpu_keras.models import gpt, vision  # noqa: F401  (registers the builders)

__all__ = ["REGISTRY", "build", "register"]
