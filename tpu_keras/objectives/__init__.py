"""Objectives by name: what a run trains its model for, registered as model families are.

`sft` (supervised: the model's own loss on text, instructions, images),
`dpo` (preference pairs) and `grpo` (prompts, completions sampled and scored
inside the run) are the toolkit's. `train.objective` chooses one; 'auto', the
default, takes the one made for the data's kind. A module of your own
(`model.imports`) registers another:

    from tpu_keras import objectives

    class Unlikelihood(objectives.Objective):
        name, data_kinds = "unlikelihood", ("text",)
        def builder(self, builder, config): ...

    objectives.register(Unlikelihood())

`check(config)` is every check a config gets before Keras loads: the
schema's (`tpu_keras.config.check`) and its objective's; `train`, `plan` and
the other commands all start with it.
"""

# Imported inside functions: the toolkit's objectives, registered once this module is
# (each imports this one's `Objective`).
from tpu_keras import config as config_lib, data_section
from tpu_keras.errors import UserError, closest
from tpu_keras.objectives.objective import Objective

REGISTRY: dict = {}
AUTO = "auto"


def register(objective: Objective) -> Objective:
    """Makes `objective` available as `train.objective=<its name>`."""
    if not objective.name:
        raise UserError(f"{type(objective).__name__} has no name; set its `name`")
    REGISTRY[objective.name] = objective
    return objective


def of(config) -> Objective:
    """The config's objective: `train.objective`, or for 'auto' the one made for the data's
    kind (supervised fine-tuning for any other)."""
    name = config.train.objective
    kind = data_section.kind(config.data)
    if name == AUTO:
        return next((o for o in REGISTRY.values() if kind in o.chosen_for), REGISTRY["sft"])
    if name not in REGISTRY:
        where = (" (the modules of model.imports register theirs)" if config.model.get("imports")
                 else "; an objective of your own is registered by a module in model.imports")
        raise UserError(f"train.objective={name!r} is not a registered objective, one of "
                        f"{sorted(REGISTRY) + [AUTO]}{closest(name, list(REGISTRY))}{where}")
    objective = REGISTRY[name]
    if kind and kind not in objective.data_kinds:
        raise UserError(f"train.objective={name!r} reads data."
                        + " or data.".join(objective.data_kinds)
                        + f", and this config reads data.{kind}; set train.objective='auto', or give "
                        "that kind of data")
    return objective


def check(config) -> None:
    """The schema's checks, then the objective's: a one-line `UserError` for what is wrong.
    An objective of the user's is checked once `model.imports` has registered it
    (`training.setup`): before that, its name cannot be told from a typo."""
    config_lib.check(config)
    if config.train.objective not in REGISTRY and config.train.objective != AUTO \
            and config.model.get("imports"):
        return
    chosen = of(config)
    defaults = config_lib.defaults()
    for objective in REGISTRY.values():
        if objective.section not in defaults or objective.section == chosen.section:
            continue  # none, the chosen one's, or a section the schema does not hold
        changed = [key for key, value in config[objective.section].items()
                   if data_section.differs(value, defaults[objective.section][key])]
        kind = data_section.kind(config.data)
        if changed and kind:
            wanted = objective.data_kinds[0]
            raise UserError(f"{objective.section}.{changed[0]} is set, but this run reads data.{kind}, "
                            f"so {objective.section} would be ignored; drop it, or set "
                            f"data.{wanted}.{data_section.WHERE[wanted]} to train with "
                            f"{objective.name.upper()}")
    chosen.check(config)
    _check_context(config, chosen)


def _check_context(config, chosen) -> None:
    context = config.mesh.get("context", 1)
    if context > 1 and not chosen.splits_sequences:
        raise UserError(f"mesh.context={context} splits the sequences of a batch, and "
                        f"{chosen.name.upper()} does not train on its rows as sequences yet; drop "
                        "mesh.context, or split the batch (mesh.data, mesh.fsdp)")


def check_registered(config) -> Objective:
    """The objective of a config whose `model.imports` are imported: checked like any other."""
    chosen = of(config)
    chosen.check(config)
    _check_context(config, chosen)
    return chosen


def _register_the_toolkits() -> None:
    from tpu_keras.objectives import dpo, grpo, sft
    for module in (sft, dpo, grpo):
        register(module.OBJECTIVE)


_register_the_toolkits()

__all__ = ["AUTO", "Objective", "REGISTRY", "check", "check_registered", "of", "register"]
