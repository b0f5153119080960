"""Examples packed apart in a row (`tpu_keras.models.segments`) against each example alone.

    python tests/helpers/segments_probe.py ENGINE [MODEL,...]

The gpt builder (learned positions, which restart per example) and keras-hub's
Llama 3, Qwen 3, SmolLM3, Gemma 3 and 4 (rotary positions; SmolLM3 leaves them
out of every other layer, Gemma 3 and 4 have sliding-window layers) and Qwen 3.5
(a Gated DeltaNet layer, `tpu_keras.models.gated_delta_net`, in chunks of
8 tokens here so that examples cross chunks), each built as a run builds it with
`model.example_end_token=0` (tf: one device; jax: a mesh of data 2 x model 2
on 4 devices), read two rows of three whole examples each, every one ending
with the end token. Each example then runs alone, padded after its end; its
logits must be the packed row's at its tokens. The same rows through the
same weights as one stream (no end token given) must differ. Prints one
line, `SEGMENTS {json}`: per model, the largest difference at real tokens,
relative to the logits' scale, and the stream's; for Qwen 3.5 also `rule`, the
gated delta rule with every token of one example against keras-hub's own
(`_chunk_gated_delta_rule`) on random inputs, relative, in chunks of 8 and 64.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json  # noqa: E402
import sys  # noqa: E402

from tpu_keras.cluster import engine  # noqa: E402

engine_name = sys.argv[1]
engine.select(engine_name, 4 if engine_name == "jax" else 0)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras.config import defaults  # noqa: E402
from tpu_keras.models import gated_delta_net  # noqa: E402
from tpu_keras.training.setup import build_model  # noqa: E402

LENGTH = 24
MODELS = {
    "gpt": dict(name="gpt", vocab_size=64, context_length=LENGTH, width=32, depth=2, num_heads=4),
    "llama": dict(name="keras_hub:Llama3CausalLM", vocabulary_size=64, num_layers=2, num_query_heads=4,
                  num_key_value_heads=2, hidden_dim=32, intermediate_dim=48, context_length=LENGTH),
    "qwen3": dict(name="keras_hub:Qwen3CausalLM", vocabulary_size=64, num_layers=2, num_query_heads=4,
                  num_key_value_heads=2, head_dim=8, hidden_dim=32, intermediate_dim=48,
                  context_length=LENGTH),
    "smollm3": dict(name="keras_hub:SmolLM3CausalLM", vocabulary_size=64, hidden_dim=32, intermediate_dim=48,
                    num_layers=2, num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
                    attention_dropout=0.0, rope_layer_enabled_list=[1, 0],
                    layer_types=["full_attention"] * 2, mlp_bias=False, layer_norm_epsilon=1e-6,
                    max_position_embeddings=LENGTH, rope_theta=10000.0, partial_rotary_factor=1.0,
                    context_length=LENGTH),
    # six layers: five sliding (a window of 6 tokens, shorter than the longest example), one global
    "gemma3": dict(name="keras_hub:Gemma3CausalLM", vocabulary_size=64, image_size=None, num_layers=6,
                   num_query_heads=4, num_key_value_heads=2, hidden_dim=32, intermediate_dim=48,
                   head_dim=8, use_post_ffw_norm=True, use_post_attention_norm=True,
                   use_sliding_window_attention=True, sliding_window_size=6, context_length=LENGTH),
    # a sliding layer and a global one (Gemma3Backbone's pattern needs six; Gemma 4 takes
    # layer_types), global heads of their own size, per-layer token embeddings, positions as an input
    "gemma4": dict(name="keras_hub:Gemma4CausalLM", vocabulary_size=64, image_size=None, num_layers=2,
                   layer_types=["sliding_attention", "full_attention"],
                   num_query_heads=4, num_key_value_heads=2, hidden_dim=32, intermediate_dim=48,
                   head_dim=8, global_head_dim=16, sliding_window_size=6, hidden_size_per_layer_input=4,
                   global_rope_partial_rotary_factor=0.25, context_length=LENGTH),
    # a Gated DeltaNet layer (2 key heads repeated to 4 value heads), then full attention
    "qwen3_5": dict(name="keras_hub:Qwen3_5CausalLM", vocabulary_size=64, num_layers=2,
                    layer_types=["linear_attention", "full_attention"], num_query_heads=4,
                    num_key_value_heads=2, head_dim=8, hidden_dim=32, intermediate_dim=48,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4, context_length=LENGTH),
}
gated_delta_net.CHUNK_SIZE = 8  # the examples below cross chunks (the default, 64, is a whole row)
rng = np.random.default_rng(0)
examples = [[rng.integers(1, 64, n - 1).tolist() + [0] for n in lengths] for lengths in ((9, 5, 10), (3, 17, 4))]
rows = np.array([sum(row, []) for row in examples], "int32")


def delta_rule_against_keras_hub():
    """The largest difference of `chunk_gated_delta_rule` over one example from keras-hub's
    rule, relative, over chunks of 8 and 64."""
    from keras_hub.src.models.qwen3_5.qwen3_5_gated_delta_net import _chunk_gated_delta_rule
    draw = np.random.default_rng(1)
    batch, length, heads = 2, LENGTH, 4
    query, key = (draw.normal(size=(batch, length, heads, 8)).astype("float32") for _ in range(2))
    value = draw.normal(size=(batch, length, heads, 6)).astype("float32")
    g = -0.5 * np.abs(draw.normal(size=(batch, length, heads))).astype("float32")
    beta = (1 / (1 + np.exp(-draw.normal(size=(batch, length, heads))))).astype("float32")
    worst = 0.0
    for chunk in (8, 64):
        ours = gated_delta_net.chunk_gated_delta_rule(query, key, value, g, beta,
                                                      np.zeros((batch, length), "int32"), chunk)
        theirs, _ = _chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=chunk)
        ours, theirs = (keras.ops.convert_to_numpy(out) for out in (ours, theirs))
        worst = max(worst, float(np.abs(ours - theirs).max() / np.abs(theirs).max()))
    return worst


def build(model, end_token):
    config = defaults()
    config.engine = engine_name
    config.model = dict(MODELS[model], example_end_token=end_token)
    config.mesh = dict(data=2, fsdp=1, model=2) if engine_name == "jax" else dict(data=-1, fsdp=1, model=1)
    cluster = tpu_keras.connect(config.cluster, engine=engine_name, mesh=config.mesh)
    keras.utils.set_random_seed(0)
    return build_model(config, cluster)


result = {}
for name in (sys.argv[2].split(",") if len(sys.argv) > 2 else MODELS):
    packed_model = build(name, 0)
    packed = keras.ops.convert_to_numpy(packed_model.predict(rows, verbose=0))
    # Each example alone in a row of its own, padded after its end: one call for all six
    # (an even count of rows, which the mesh splits in two).
    each = [example for row in examples for example in row]
    tokens = np.ones((len(each), LENGTH), "int32")
    for i, example in enumerate(each):
        tokens[i, :len(example)] = example
    outputs = keras.ops.convert_to_numpy(packed_model.predict(tokens, verbose=0))
    alone, i = [], 0
    for r, row in enumerate(examples):
        start = 0
        for example in row:
            out = outputs[i, :len(example)]
            alone.append(float(np.abs(out - packed[r, start:start + len(example)]).max()))
            start, i = start + len(example), i + 1
    stream_model = build(name, -1)
    stream_model.set_weights(packed_model.get_weights())
    stream = keras.ops.convert_to_numpy(stream_model.predict(rows, verbose=0))
    scale = float(np.abs(packed).max())
    result[name] = {"alone": max(alone) / scale, "stream": float(np.abs(stream - packed).max()) / scale}
    if name == "qwen3_5":
        result[name]["rule"] = delta_rule_against_keras_hub()
print("SEGMENTS " + json.dumps(result), flush=True)
