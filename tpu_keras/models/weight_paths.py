"""Variables keyed by name, so that two sets of them pair by name, never by position.

Keras lists a model's weights in the order its layers create them, and that
order can change between the environment that saved them and the one that
loads them (a keras-hub upgrade that builds `key` before `query`, or `up`
before `gate`): paired by position, same-shaped weights would swap without a
word. So checkpoints (`training/checkpoint.py`) and the export's host copy
(`models/export.py`) pair variables by these keys:

- a weight (`model.weights`): its `variable.path`
  ('block0_attention/query/kernel');
- a model's other variables (a seed generator's state): 'random_state/<i>',
  in order, since Keras names them with a process-wide counter
  ('seed_generator_3'), which depends on what the process built before;
- an optimizer's variable: its path less the optimizer's own name, which
  Keras counts per process too ('adam_w_1/iteration' -> 'iteration'; a slot's
  name holds its weight's path: 'block0_mlp_up_kernel_momentum'); a
  `LossScaleOptimizer`'s inner optimizer's under 'inner/'.

A key met again (two layers built under one name) takes '#2', '#3', ... in order.

A layer built without a name takes one from a process-wide counter as well
(keras-hub's MoE blocks: 'qwen3_sparse_moe_block_2'), and its weights' paths
hold it. A copy rebuilt from a model's config in the same process is built
inside `numbered_like(model)`, which makes its counters start where the model's
did, so that the two pair by path.
"""

import collections
import contextlib
import re

# Imported inside functions: Keras's private naming state, which only `numbered_like` reads
# (checkpoints import this module on every engine, and need none of it).

RANDOM_STATE = "random_state/"


def weights(layer) -> dict:
    """{path: weight} of `layer.weights`."""
    return _unique((w.path, w) for w in layer.weights)


def model_variables(model) -> dict:
    """{key: variable} of `model.variables`: the weights by path, the rest in order."""
    keyed = weights(model)
    own = {id(w) for w in model.weights}
    others = [v for v in model.variables if id(v) not in own]
    return {**keyed, **{f"{RANDOM_STATE}{i}": v for i, v in enumerate(others)}}


def optimizer_variables(optimizer) -> dict:
    """{key: variable} of `optimizer.variables`, keyed apart from the optimizer's own name."""
    inner = getattr(optimizer, "inner_optimizer", None)  # keras.optimizers.LossScaleOptimizer
    inner_ids = {id(v) for v in inner.variables} if inner is not None else set()

    def key(variable):
        name = variable.path.split("/", 1)[-1]
        return f"inner/{name}" if id(variable) in inner_ids else name
    return _unique((key(v), v) for v in optimizer.variables)


@contextlib.contextmanager
def numbered_like(model):
    """Layers built inside are auto-named as `model`'s were: each class's counter starts at
    the lowest number `model`'s unnamed layers of that class took. Keras 3.15 keeps the
    counters in global_state's 'object_name_uids' ({snake_case class name: next number})."""
    from keras.src.backend.common import global_state
    from keras.src.utils.naming import to_snake_case
    first = {}
    for layer in model._flatten_layers(include_self=False):
        prefix = to_snake_case(type(layer).__name__)
        match = re.fullmatch(re.escape(prefix) + r"(?:_(\d+))?", layer.name)
        if match:
            number = int(match.group(1) or 0)
            first[prefix] = min(first.get(prefix, number), number)
    saved = global_state.get_global_attribute("object_name_uids")
    counters = collections.defaultdict(int, {prefix: n for prefix, n in first.items() if n})
    global_state.set_global_attribute("object_name_uids", counters)
    try:
        yield
    finally:  # the process's counters, past every name the copy took: names stay unique
        if saved is not None:
            for prefix, n in counters.items():
                saved[prefix] = max(saved[prefix], n)
        global_state.set_global_attribute("object_name_uids", saved if saved is not None else counters)


def _unique(pairs) -> dict:
    keyed = {}
    for key, value in pairs:
        unique, n = key, 1
        while unique in keyed:
            n += 1
            unique = f"{key}#{n}"
        keyed[unique] = value
    return keyed


def mismatch(saved: dict, wanted: dict, noun: str = "weight", there: str = "the checkpoint",
             here: str = "this model"):
    """The first difference between `saved` and `wanted` (each {key: shape}) in words, with
    how many more there are; None when both hold the same keys with the same shapes."""
    def shape(key, side):
        return list(map(int, side[key]))
    missing = [k for k in wanted if k not in saved]
    extra = [k for k in saved if k not in wanted]
    reshaped = [k for k in wanted if k in saved and shape(k, saved) != shape(k, wanted)]
    if missing and extra:  # most often one weight under another name: show both
        first = (f"{noun} {missing[0]!r} {shape(missing[0], wanted)} of {here} is not in {there}, "
                 f"which holds {extra[0]!r} {shape(extra[0], saved)} instead")
        if _unnumbered(missing[0]) == _unnumbered(extra[0]):
            first += (" (Keras numbers the names of unnamed layers and models, 'dense_1', in "
                      "the order a process creates them: name them)")
    elif missing:
        first = f"{noun} {missing[0]!r} {shape(missing[0], wanted)} of {here} is not in {there}"
    elif extra:
        first = f"{there} holds {noun} {extra[0]!r} {shape(extra[0], saved)}, which {here} lacks"
    elif reshaped:
        key = reshaped[0]
        first = f"{noun} {key!r} is {shape(key, saved)} in {there} and {shape(key, wanted)} in {here}"
    else:
        return None
    more = len(missing) + len(extra) + len(reshaped) - (2 if missing and extra else 1)
    return first + (f" (and {more} more difference{'s' if more > 1 else ''})" if more else "")


def _unnumbered(path: str) -> str:
    return re.sub(r"_\d+(?=/|$)", "", path)
