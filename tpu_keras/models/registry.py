"""Model builders by name, each with the loss and metrics of its task.

A builder is a plain function whose keyword arguments are the `model` config
section (minus `name`), so its signature is the schema that section is
checked against. Each builder also has layout rules (`tpu_keras.parallelism`):
which weights split over the mesh's `model` axis.
"""

import dataclasses
import inspect
from typing import Callable

import keras

from tpu_keras import parallelism
from tpu_keras.errors import UserError, closest


@dataclasses.dataclass(frozen=True)
class Builder:
    make: Callable[..., keras.Model]
    loss: Callable[[], keras.losses.Loss]
    metrics: Callable[[], list]
    # The metric that sums up a run in one number, as in `val_<headline>`.
    headline: str
    # Tokens per example, for tokens/s in the log (0 for non-sequence models).
    tokens_per_example: Callable[[dict], int] = lambda kwargs: 0
    # Layout rules for the model these keyword arguments build.
    layout: Callable[[dict], list[parallelism.Rule]] = lambda kwargs: []


REGISTRY: dict[str, Builder] = {}


def register(name, *, loss, metrics, headline, tokens_per_example=lambda kwargs: 0,
             layout=lambda kwargs: []):
    def decorate(make):
        REGISTRY[name] = Builder(make, loss, metrics, headline, tokens_per_example, layout)
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


def layout_rules(model_config, layout_config=None) -> list[parallelism.Rule]:
    """The builder's layout rules, or `layout.rules` from the config when it sets any."""
    return _rules(*get(model_config), layout_config)


def _rules(builder, kwargs, layout_config):
    if layout_config and layout_config.get("rules"):
        return parallelism.rules_from_pairs(layout_config["rules"])
    return builder.layout(kwargs)


def build(model_config) -> keras.Model:
    """Builds the model `model_config` names, under the current strategy scope or distribution.

    It only builds: laying the weights out and checking the layout rules
    against them is the caller's (see `tpu_keras.training.run.build_model`).
    """
    builder, kwargs = get(model_config)
    try:
        return builder.make(**kwargs)
    except (TypeError, ValueError) as error:  # a model.* value the builder cannot use
        reason = " ".join(str(error).split())[:300] or type(error).__name__
        raise UserError(f"model {dict(model_config).get('name')!r} cannot be built "
                        f"from model={kwargs} ({reason}); check the model.* values") from None
