"""The run's config, resolved once: `resolve(config, cluster, workdir, checkpointed)`.

A user's config leaves some values to the run: `auto` choices the platform
makes, a preset inside the run's folder, what packed text takes from the model
and the run. `resolve` fills them in one step, before the model is built, and
returns the config the run uses, frozen (`ml_collections.FrozenConfigDict`:
`config.x.y` reads as before, and nothing writes to it). The chief writes that
to `WORKDIR/config.json` (`training.setup`), so the workdir records what ran;
`python -m tpu_keras.evaluate`, `export` and `generate` read it back
(`tpu_keras.config.read_run_config`) and resolve it again, which changes
nothing.

Each piece is a pure function of the config that returns values:

- `training.auto_values.resolve`: `train.precision` and `train.steps_per_execution`
  for this platform;
- `models.hub.expand_preset` and `models.preset_copy.use`: `model.preset`, `{workdir}`
  expanded, or the model the run kept once it has a checkpoint; `models.hub.expand_command`:
  `model.preset_written_by`, the command its missing preset's error names;
- `data.text.resolve`: `data.tokens.counts`, `.context_length` and
  `.vocabulary` of packed text (after the preset: the tokenizer may be its);
- `data.text.example_end_token`: `model.example_end_token`, the data's end token,
  where examples are packed apart (the model keeps each to itself);
- `models.registry.absolute_imports`: `model.imports`' files, found from any folder.
"""

import inspect

import ml_collections

from tpu_keras import config as config_lib, data_section
from tpu_keras.data import text
from tpu_keras.errors import UserError
from tpu_keras.models import hub, preset_copy, registry
from tpu_keras.training import auto_values


def resolve(config, cluster, workdir: str, checkpointed: bool) -> ml_collections.FrozenConfigDict:
    """The config a run in `workdir` on `cluster` uses, frozen; `config` is left as it is.

    `checkpointed`: the weights come from a checkpoint (a resume, or a command that
    reads the run), so a model the run kept (DIR/model) replaces `model.preset`.
    """
    resolved = config_lib.thawed(config)
    resolved.train.update(auto_values.resolve(resolved, cluster))
    if "preset" in resolved.model:
        resolved.model.preset = preset_copy.use(hub.expand_preset(resolved.model.preset, workdir),
                                         workdir, checkpointed)
    if resolved.model.get("preset_written_by"):
        resolved.model.preset_written_by = hub.expand_command(resolved.model.preset_written_by,
                                                              workdir)
    resolved.data.tokens.update(text.resolve(resolved, workdir))
    if data_section.kind(resolved.data) in ("text", "instructions") \
            and text.packing_of(resolved.data) is not None:
        _check_keeps_examples_apart(resolved.model)
        with resolved.unlocked():  # a key of the model's the run fills in
            resolved.model.example_end_token = text.example_end_token(resolved.data)
    if resolved.model.get("imports"):  # files of the user's, found from any folder later
        resolved.model.imports = registry.absolute_imports(resolved.model.imports)
    return ml_collections.FrozenConfigDict(resolved)


def _check_keeps_examples_apart(model_config) -> None:
    """A one-line error for a model that takes no `example_end_token`."""
    builder, _ = registry.get(model_config)
    accepted = (builder.arguments if builder.arguments is not None
                else inspect.signature(builder.make).parameters)
    if "example_end_token" not in accepted:
        raise UserError(f"the data pack examples apart (data.instructions or data.text.document_masks), "
                        f"and model {model_config.get('name')!r} takes no example_end_token to keep "
                        "them apart; use a language model of the toolkit's (gpt, a keras-hub causal "
                        "LM), or set data.text.document_masks=False")


def to_json(resolved: ml_collections.FrozenConfigDict, config) -> str:
    """`resolved` as WORKDIR/config.json holds it: indented JSON, its keys in the order of
    `config`, the config it was resolved from (a FrozenConfigDict sorts them)."""
    ordered = config_lib.thawed(config)
    with ordered.unlocked():  # with the keys the run filled in (model.example_end_token)
        ordered.update(resolved.to_dict())
    return ordered.to_json_best_effort(indent=2)

