"""Model builders by name, each with the loss and metrics of its task.

A builder is a plain function whose keyword arguments are the `model` config
section (minus `name`), so its signature is the schema that section is
checked against. Each builder also has layout rules (`tpu_keras.parallelism`):
which weights split over the mesh's `model` axis. A family of builders can
also be registered by a name prefix (`keras_hub:LlamaCausalLM`, see
`tpu_keras.models.hub`), each made when a config names it.

`model.imports` names Python modules or `.py` files of your own that
register builders (`register`) or model families (`models.families`); they
are imported before the builder is looked up, by every command that reads
the config (the run's `config.json` keeps them for `evaluate`, `export`,
`generate`).
"""

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Callable

import keras

from tpu_keras import parallelism
from tpu_keras.errors import UserError, closest
from tpu_keras.models import block_remat, moe


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
    # Dimensions that must be split alike (attention heads, MLP units).
    ties: Callable[[dict], list[parallelism.Tie]] = lambda kwargs: []
    # The model.* keys it takes; None: the arguments of `make`.
    arguments: tuple[str, ...] | None = None


# model.* keys of the registry's own, never a builder's argument.
RESERVED = ("name", "imports")
REGISTRY: dict[str, Builder] = {}
# Families of builders made on demand from a name: prefix -> (make_builder(rest, kwargs), example).
FAMILIES: dict[str, tuple[Callable[[str, dict], Builder], str]] = {}


def register(name, *, loss, metrics, headline, tokens_per_example=lambda kwargs: 0,
             layout=lambda kwargs: [], ties=lambda kwargs: []):
    def decorate(make):
        REGISTRY[name] = Builder(make, loss, metrics, headline, tokens_per_example, layout, ties)
        return make
    return decorate


def register_family(prefix: str, make_builder, example: str):
    """Names that start with `prefix` are builders `make_builder(rest_of_name, kwargs)` makes."""
    FAMILIES[prefix] = (make_builder, example)


def get(model_config) -> tuple[Builder, dict]:
    """Looks up a builder and checks the config's keys against its arguments."""
    kwargs = dict(model_config)
    name = kwargs.pop("name", "")
    import_all(kwargs.pop("imports", ()))
    family = next((prefix for prefix in FAMILIES if name.startswith(prefix)), None)
    if family is not None:
        builder = FAMILIES[family][0](name[len(family):], kwargs)
    elif name in REGISTRY:
        builder = REGISTRY[name]
    else:
        examples = "".join(f", or {example!r}" for _, example in FAMILIES.values())
        raise UserError(f"model.name={name!r} is not a registered builder{closest(name, REGISTRY)}; "
                        f"choose one of {sorted(REGISTRY)}{examples}")
    accepted = (builder.arguments if builder.arguments is not None
                else inspect.signature(builder.make).parameters)
    for key in kwargs:
        if key not in accepted:
            raise UserError(f"unknown config key 'model.{key}' for builder {name!r}"
                            f"{closest(key, accepted)}")
    return builder, kwargs


def import_all(names) -> None:
    """Imports each of `names` once: a module ('my_models.otter') or a .py file's path."""
    for name in [names] if isinstance(names, str) else names:
        import_user_module(name, "model.imports")


def import_user_module(name: str, key: str):
    """The module `name` names, imported once: a module ('my_models.otter') or a .py file's
    path; a one-line error naming the config `key` where neither is found."""
    if name.endswith(".py"):
        path = os.path.abspath(name)
        module = f"tpu_keras_imports.{os.path.splitext(os.path.basename(path))[0]}"
        if module in sys.modules:
            return sys.modules[module]
        if not os.path.exists(path):
            raise UserError(f"{key} has {name!r}, which does not exist (relative paths "
                            f"start at {os.getcwd()}); give the file's path or a module name")
        spec = importlib.util.spec_from_file_location(module, path)
        sys.modules[module] = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(sys.modules[module])
        except Exception:
            del sys.modules[module]
            raise
        return sys.modules[module]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        raise UserError(f"{key} has {name!r}, which cannot be imported ({error}); put "
                        "its folder on PYTHONPATH, or give the .py file's path") from None


def absolute_imports(names) -> tuple[str, ...]:
    """`model.imports` with each .py file's path absolute, modules as they are."""
    names = (names,) if isinstance(names, str) else tuple(names)
    return tuple(os.path.abspath(name) if name.endswith(".py") else name for name in names)


def placer(model_config, layout_config, mesh: dict) -> parallelism.Placer:
    """The `Placer` for this model on `mesh`: its rules, its ties, `layout.replicate_below`
    and `layout.split_logits`."""
    builder, kwargs = get(model_config)
    rules = _rules(builder, kwargs, layout_config)
    experts = (mesh or {}).get("expert", 1)
    if experts > 1 and not any("expert" in rule.axes for rule in rules):
        raise UserError(f"mesh.expert={experts} splits the experts of a mixture of experts, and "
                        f"model {dict(model_config).get('name')!r} has none (no layout rule names "
                        "'expert'); split its batch with mesh.data or mesh.fsdp instead")
    return parallelism.Placer(rules, mesh,
                              layout_config.get("replicate_below", parallelism.REPLICATE_BELOW),
                              ties=builder.ties(kwargs),
                              split_logits=bool(layout_config.get("split_logits", False)))


def _rules(builder, kwargs, layout_config):
    layout_config = layout_config or {}
    rules = (parallelism.rules_from_pairs(layout_config["rules"]) if layout_config.get("rules")
             else builder.layout(kwargs))
    return rules + parallelism.rules_from_pairs(layout_config.get("extra_rules", ()))


def build(model_config, remat: str = "none") -> keras.Model:
    """Builds the model `model_config` names, under the current strategy scope or distribution.

    `remat` is `train.remat` (`made_with_remat`). It only builds: laying the
    weights out and checking the layout rules against them is the caller's
    (`tpu_keras.training.setup.build_model`).
    """
    builder, kwargs = get(model_config)
    try:
        return made_with_remat(lambda: builder.make(**kwargs), remat, model_config)
    except (TypeError, ValueError) as error:  # a model.* value the builder cannot use
        reason = " ".join(str(error).split())[:300] or type(error).__name__
        raise UserError(f"model {dict(model_config).get('name')!r} cannot be built "
                        f"from model={kwargs} ({reason}); check the model.* values") from None


def made_with_remat(make: Callable[[], keras.Model], remat: str, model_config) -> keras.Model:
    """`make()` under `train.remat`: 'activations' is a `keras.RematScope` mode, which Keras
    fixes when a layer is made; 'blocks' wraps each transformer block once it is made
    (`models.block_remat`)."""
    # Keras's None for 'none' and for 'blocks', which is applied below
    with keras.RematScope(mode=remat if remat == "activations" else None):
        model = make()
    if remat == "blocks" and not block_remat.apply(model):
        raise UserError(f"train.remat='blocks' recomputes each transformer block, and model "
                        f"{dict(model_config).get('name')!r} has none the toolkit knows (a keras-hub "
                        "backbone's transformer_layers); use train.remat='activations'")
    moe.check_remat(model, remat)
    if remat == "blocks":
        moe.unrecorded(model)
    return model
