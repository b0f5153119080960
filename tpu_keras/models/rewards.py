"""Reward functions for GRPO (`models.grpo`): Python functions a config names, run on the host.

A reward is named `"module:function"` (a module on the path, `my_rewards`)
or `"path/to/my_rewards.py:function"`, as TRL's `reward_funcs` are
functions. It is called once per batch of samples, as TRL calls one:

    function(prompts, completions, **fields) -> one float per completion

`prompts` and `completions` are lists of strings, a prompt repeated for each
of its group's completions; `fields` are the prompt's JSONL line's other
keys, a list each, in the same order (the answer a math reward checks
against, the tests a code reward runs). Several rewards are summed with
their weights (TRL's `reward_weights`; 1 each by default). A value that is
not one finite float per completion is a one-line error naming the
function: a NaN reward would poison the group's advantages silently.
"""

import dataclasses
import math
from typing import Callable

import numpy as np

from tpu_keras.errors import UserError
from tpu_keras.models import registry

@dataclasses.dataclass(frozen=True)
class Reward:
    name: str           # as the config names it: 'my_rewards:is_correct'
    function: Callable
    weight: float = 1.0


def load(names, weights=(), key: str = "rewards") -> tuple[Reward, ...]:
    """The reward functions `names` names, each with its weight; one-line errors that name
    the config `key` they came from."""
    names = (names,) if isinstance(names, str) else tuple(names)
    if not names:
        raise UserError(f"{key} is empty; name at least one reward function, such as "
                        "'my_rewards:is_correct' (a module on the path) or 'my_rewards.py:is_correct'")
    weights = tuple(weights) or (1.0,) * len(names)
    if len(weights) != len(names):
        raise UserError(f"{len(weights)} reward weight(s) for the {len(names)} reward function(s) "
                        f"of {key}; give one weight per function, or none")
    loaded = []
    for name, weight in zip(names, weights):
        where, colon, attribute = name.rpartition(":")
        if not colon or not where or not attribute:
            raise UserError(f"{key} has {name!r}, which is not 'module:function'; name one such "
                            "as 'my_rewards:is_correct' or 'path/to/my_rewards.py:is_correct'")
        try:
            module = registry.import_user_module(where, f"{key} ({name!r})")
        except UserError:
            raise  # not found: already one line
        except Exception as error:  # whatever the user's module raised as it was imported
            raise UserError(f"{key} has {name!r}, whose module raised {type(error).__name__} "
                            f"as it was imported: {error}") from None
        function = getattr(module, attribute, None)
        if not callable(function):
            raise UserError(f"{key} has {name!r}, but {where} has no function {attribute!r}; "
                            f"name one of its functions")
        loaded.append(Reward(name, function, float(weight)))
    return tuple(loaded)


def score(rewards, prompts: list, completions: list, fields: dict):
    """(total [n] float32: the weighted sum, {name: [n] float32}) of `n` completions."""
    each = {}
    for reward in rewards:
        try:
            values = reward.function(prompts=prompts, completions=completions, **fields)
        except Exception as error:  # the user's function failed: name it, keep the message
            raise UserError(f"reward function {reward.name} raised {type(error).__name__}: "
                            f"{error}") from None
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError):
            raise UserError(f"reward function {reward.name} returned {type(values).__name__} "
                            f"{str(values)[:80]!r}; return one float per completion") from None
        if len(values) != len(completions):
            raise UserError(f"reward function {reward.name} returned {len(values)} value(s) for "
                            f"{len(completions)} completions; return one float per completion")
        bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        if bad is not None:
            raise UserError(f"reward function {reward.name} returned {values[bad]} for completion "
                            f"{bad} (prompt {prompts[bad][:60]!r}); return finite floats")
        each[reward.name] = np.asarray(values, np.float32)
    total = sum(reward.weight * each[reward.name] for reward in rewards)
    return np.asarray(total, np.float32), each
