"""Examples packed apart in one row: which example each token is in, read from the tokens.

Every example the toolkit packs ends with the tokenizer's end token
(`data.documents`: a document's tokens then the end token; a prompt, its
response, then the end token), and no example holds one inside. So where a
row's examples must not see each other (instruction data; text with
`data.text.document_masks`), a model told the end token
(`model.example_end_token`, which the run sets from the data) finds each
token's example itself: the example of token i is the number of end tokens
before it. Attention then stays inside an example, and a model whose
positions are absolute (the `gpt` builder's learned ones) restarts them at
each example's first token. A row that holds one example, as a prompt to
continue or an example run alone, is the same function: the model's input
stays token ids alone, and generation, the exports and the plan need
nothing of their own. A row's padding after its last example is one more
"example" that no real token sees (attention looks back only).

keras-hub models compute attention in their attention layers'
`_compute_attention(query, key, value, attention_mask, ...)`, with the
causal and padding mask keras-hub builds; `keep_examples_apart` makes those of the
families' attention classes (`Family.attention`) also require the same
example (`current`, the ids of the call in progress), and the TPU's fused
kernel takes the ids as its segment ids (`splash_attention`). Linear
attention that carries a state along the row (the families' `delta_nets`:
Qwen 3.5's Gated DeltaNet) has no mask to restrict: those layers' calls
without a cache go through `gated_delta_net` (`route_delta_nets`, in every
model the toolkit builds), which restarts their state and convolution at each
example's first token. Rotary
positions make attention scores depend on distances alone, so those models
keep their positions: the logits of an example are the same wherever it
sits in a row.
"""

import contextlib
import functools

import keras

from tpu_keras.models import families, gated_delta_net

_CURRENT = []  # the example ids of the call being traced, innermost last


def example_ids(tokens, end_token: int):
    """(batch, length) int32: each token's example, 0 for the first, counting the end tokens
    before it."""
    ends = keras.ops.cast(keras.ops.equal(tokens, end_token), "int32")
    return keras.ops.cumsum(ends, axis=-1) - ends


def positions(ids):
    """Each token's position inside its example: 0 at the example's first token."""
    index = keras.ops.zeros_like(ids) + keras.ops.arange(ids.shape[-1], dtype="int32")
    starts = keras.ops.concatenate([keras.ops.ones_like(ids[:, :1]),
                                    keras.ops.cast(ids[:, 1:] != ids[:, :-1], "int32")], axis=-1)
    first = keras.ops.where(starts > 0, index, keras.ops.zeros_like(index))
    return index - _running_max(first)  # its example's start


def same_example(ids):
    """(batch, length, length) bool: query i and key j are in one example."""
    return keras.ops.equal(keras.ops.expand_dims(ids, -1), keras.ops.expand_dims(ids, -2))


def _running_max(values):
    """The running maximum along the last axis, by log2(length) doubling steps: static shapes
    on both engines (Keras's `associative_scan` loses the rank inside a tf.function)."""
    length, shift = values.shape[-1], 1
    while shift < length:
        values = keras.ops.maximum(values, keras.ops.pad(values[:, :-shift], [[0, 0], [shift, 0]]))
        shift *= 2
    return values


@contextlib.contextmanager
def current(ids):
    """While open, the attention `keep_examples_apart` routed keeps to the examples `ids` say."""
    _CURRENT.append(ids)
    try:
        yield
    finally:
        _CURRENT.pop()


def current_ids():
    """The example ids of the call in progress, or None outside `current`."""
    return _CURRENT[-1] if _CURRENT else None


def keep_examples_apart(model) -> int:
    """Makes the attention layers of `model`'s families keep to one example while `current`
    ids are set (their mask's minimum with `same_example`), and their Gated DeltaNet layers
    restart at each example (`route_delta_nets`); returns how many layers."""
    attention = {name for family in families.known() for name in family.attention}
    routed = route_delta_nets(model)
    for layer in model._flatten_layers(include_self=False):
        if type(layer).__name__ in attention and not getattr(layer, "_tpu_keras_segments", False):
            object.__setattr__(layer, "_compute_attention",
                               functools.partial(_within_examples, layer._compute_attention))
            object.__setattr__(layer, "_tpu_keras_segments", True)
            routed += 1
    return routed


def route_delta_nets(model) -> int:
    """Makes every Gated DeltaNet layer of `model` (its family's `delta_nets`) compute its
    calls without a cache (training, evaluation, scoring) with `gated_delta_net`: each
    example of the `current` ids apart, or the whole row as one where none are set. Its
    rule equals keras-hub's within float32's rounding (1e-6 of the output) and compiles in
    a fifth of the time (keras-hub 0.32 unrolls a 63-step loop in every chunk). Calls with
    a cache (generation) stay keras-hub's. Returns how many layers it routed."""
    classes = {name for family in families.known() for name in family.delta_nets}
    routed = 0
    for layer in model._flatten_layers(include_self=False):
        if type(layer).__name__ in classes and not getattr(layer, "_tpu_keras_delta_net", False):
            object.__setattr__(layer, "call", functools.partial(_delta_net, layer, layer.call))
            object.__setattr__(layer, "_tpu_keras_delta_net", True)
            routed += 1
    return routed


class ExamplesApart(keras.layers.Layer):
    """A keras-hub causal LM task called on token ids, its examples apart: the ids of each
    token's example are `current` while the task runs (its attention, routed by
    `keep_examples_apart`, keeps to them), and its padding mask is all ones."""

    def __init__(self, task, end_token: int, **kwargs):
        super().__init__(**kwargs)
        self.task, self.end_token = task, end_token

    def call(self, tokens):
        with current(example_ids(tokens, self.end_token)):
            return self.task(task_inputs(self.task, tokens))

    def get_config(self):
        return {**super().get_config(), "end_token": self.end_token,
                "task": keras.saving.serialize_keras_object(self.task)}


def task_inputs(task, tokens) -> dict:
    """A keras-hub causal LM's inputs for rows of real tokens: the ids, a padding mask of ones,
    and each token's position where the backbone takes positions as an input (Gemma 4's)."""
    inputs = {"token_ids": tokens, "padding_mask": keras.ops.ones_like(tokens)}
    if "position_ids" in getattr(task.backbone, "input", {}):
        inputs["position_ids"] = keras.ops.zeros_like(tokens) + keras.ops.arange(tokens.shape[-1],
                                                                                 dtype="int32")
    return inputs


def _within_examples(compute, query, key, value, attention_mask=None, *args, **kwargs):
    ids = current_ids()
    if ids is not None and attention_mask is not None and attention_mask.shape[-1] == ids.shape[-1] \
            and attention_mask.shape[-2] == ids.shape[-1]:
        same = same_example(ids)
        if keras.backend.standardize_dtype(attention_mask.dtype) == "bool":
            attention_mask = keras.ops.logical_and(attention_mask, same)
        else:
            attention_mask = keras.ops.minimum(attention_mask, keras.ops.cast(same, attention_mask.dtype))
    return compute(query, key, value, attention_mask, *args, **kwargs)


def _delta_net(layer, call, hidden_states, attention_mask=None, cache=None, cache_update_index=None,
               training=None):
    if cache is not None:
        return call(hidden_states, attention_mask=attention_mask, cache=cache,
                    cache_update_index=cache_update_index, training=training)
    ids = current_ids()
    if ids is None or ids.shape[-1] != hidden_states.shape[1]:
        ids = keras.ops.zeros_like(hidden_states[..., 0], dtype="int32")  # the row is one example
    return gated_delta_net.call_within_examples(layer, hidden_states, ids, attention_mask)
