"""Model builders by name, each with the loss and metrics of its task.

A builder is a plain function whose keyword arguments are the `model` config
section (minus `name`), so its signature is the schema that section is
checked against.
"""

import dataclasses
import inspect
from typing import Callable

import keras
import tensorflow as tf

from tpu_keras.errors import UserError, closest
from tpu_keras.steps import distributed_steps


@dataclasses.dataclass(frozen=True)
class Builder:
    make: Callable[..., keras.Model]
    loss: Callable[[], keras.losses.Loss]
    metrics: Callable[[], list]
    # The metric that sums up a run in one number, as in `val_<headline>`.
    headline: str
    # Tokens per example, for tokens/s in the log (0 for non-sequence models).
    tokens_per_example: Callable[[dict], int] = lambda kwargs: 0


REGISTRY: dict[str, Builder] = {}


def register(name, *, loss, metrics, headline, tokens_per_example=lambda kwargs: 0):
    def decorate(make):
        REGISTRY[name] = Builder(make, loss, metrics, headline, tokens_per_example)
        return make
    return decorate


def get(model_config) -> tuple[Builder, dict]:
    """Looks up a builder and checks the config's keys against its arguments."""
    kwargs = dict(model_config)
    name = kwargs.pop("name", "")
    if name not in REGISTRY:
        raise UserError(f"model.name={name!r} is not a registered builder{closest(name, REGISTRY)}; "
                        f"choose one of {sorted(REGISTRY)}")
    builder = REGISTRY[name]
    accepted = inspect.signature(builder.make).parameters
    for key in kwargs:
        if key not in accepted:
            raise UserError(f"unknown config key 'model.{key}' for builder {name!r}"
                            f"{closest(key, accepted)}")
    return builder, kwargs


def build(model_config, strategy: tf.distribute.Strategy | None = None) -> keras.Model:
    """Builds the model inside `strategy.scope()`, with step functions that work under it."""
    builder, kwargs = get(model_config)
    with (strategy or tf.distribute.get_strategy()).scope():
        return distributed_steps(builder.make(**kwargs))
