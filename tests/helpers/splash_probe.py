"""keras-hub's Llama, Qwen 3, Gemma 3 and 4, Qwen 3.5 with splash attention against their own attention.

    python tests/helpers/splash_probe.py

The kernel runs in Pallas's interpreter (a CPU has no TPU kernels), on 8
fake devices; its numbers are the TPU kernel's. Each model (grouped-query, 4
heads over 2 key heads, 256 tokens: two of the kernel's tiles; Gemma 3 with
five sliding layers of 128 keys and one global layer) under a data=2 x
fsdp=2 x model=2 distribution computes its outputs and the gradients of a
loss that weighs only real tokens, once with keras-hub's attention and once
routed through `models.splash_attention`, on a batch with right and left
padding. Then rows that pack examples apart (`models.segments`: each ends
with the end token, and the kernel takes each token's example as its
segment id) go through the kernel, against each example run alone through
keras-hub's own attention. Prints one line, `SPLASH {json}`: per model, how
many layers were routed, the largest differences at real tokens and in the
gradients, the largest difference at padding (which the kernel may change),
the largest difference of the packed examples' outputs; whether the
kernel's sliding-window mask is keras-hub's; and what `route` does on CPU
devices. One process: start-up is most of the time.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json  # noqa: E402

from tpu_keras.cluster import engine  # noqa: E402

engine.select("jax", virtual_devices=8)

import jax  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

from tpu_keras.cluster.record import Cluster  # noqa: E402
from tpu_keras.models import segments, splash_attention  # noqa: E402
from tpu_keras.parallelism import mesh as mesh_lib  # noqa: E402

SIZES = {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "model": 2}
mesh = keras.distribution.DeviceMesh(tuple(SIZES[a] for a in mesh_lib.AXES), mesh_lib.AXES,
                                     jax.devices())
keras.distribution.set_distribution(keras.distribution.ModelParallel(
    layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="data"))
SMALL = dict(vocabulary_size=64, num_query_heads=4, num_key_value_heads=2, hidden_dim=64,
             intermediate_dim=128)
rows, length, window = 8, 256, 128
rng = np.random.default_rng(0)
padding = np.ones((rows, length), "int32")
padding[1, 200:] = 0  # right padding
padding[3, 7:] = 0
padding[5, :30] = 0  # left padding
batch = {"token_ids": rng.integers(0, 64, (rows, length)).astype("int32"), "padding_mask": padding}
real = padding.astype(bool)
# The loss weighs each real token's output along a direction of its own: a final RMS norm makes
# the sum of squares of its outputs nearly constant (Gemma 3's, of scale 1 + 0), and its gradient
# rounding noise.
direction = (rng.standard_normal((rows, length, 64)) * padding[..., None]).astype("float32")


def packed_rows():
    """Four rows (the batch axes split 4 ways) of whole examples, each ended by the end token 0."""
    lengths = [(100, 80, 76), (7, 150, 99), (256,), (3, 3, 250)]
    examples = [[np.append(rng.integers(1, 64, n - 1), 0).astype("int32") for n in row] for row in lengths]
    return examples, np.stack([np.concatenate(row) for row in examples])


examples, packed = packed_rows()


def with_positions(backbone, inputs):
    """`inputs`, with each token's position where the backbone takes them (Gemma 4)."""
    if "position_ids" not in backbone.input:
        return inputs
    return {**inputs, "position_ids": np.broadcast_to(np.arange(inputs["token_ids"].shape[1], dtype="int32"),
                                                      inputs["token_ids"].shape)}


def segments_routed(backbone):
    segments.route_delta_nets(backbone)
    return backbone


def compare(backbone):
    """The figures of one model: keras-hub's attention, then the kernel's."""
    weights = [v.value for v in backbone.trainable_variables]
    fixed = [v.value for v in backbone.non_trainable_variables]  # Gemma 4's layer scalars
    inputs = with_positions(backbone, batch)

    def outputs_and_gradients():
        def loss(w):
            out = backbone.stateless_call(w, fixed, inputs)[0]
            return (out.astype("float32") * direction).sum(), out
        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(weights)
        return np.asarray(out), [np.asarray(g) for g in grads]

    # keras-hub's attention, compiled once (traced at the first example, before the kernel is
    # routed in): called eagerly, each operation ran on its own over the 8 devices, for every example.
    keras_hubs = jax.jit(lambda w, x: backbone.stateless_call(w, fixed, x)[0])

    def alone(example):
        """keras-hub's output for one example alone, right-padded to the row length."""
        tokens, mask = np.zeros((1, length), "int32"), np.zeros((1, length), "int32")
        tokens[0, :len(example)], mask[0, :len(example)] = example, 1
        inputs = with_positions(backbone, {"token_ids": tokens, "padding_mask": mask})
        return np.asarray(keras_hubs(weights, inputs))[0, :len(example)]

    alone_outputs = [[alone(example) for example in row] for row in examples]
    keras_out, keras_grads = outputs_and_gradients()
    routed = splash_attention.route_layers(backbone, interpret=True, shortest=256)
    splash_out, splash_grads = outputs_and_gradients()
    segments.keep_examples_apart(backbone)
    ids = segments.example_ids(packed, 0)
    with segments.current(ids):  # traced inside: the kernel's segments are the examples
        packed_inputs = with_positions(backbone, {"token_ids": packed, "padding_mask": np.ones_like(packed)})
        packed_out = np.asarray(jax.jit(lambda w: backbone.stateless_call(w, fixed, packed_inputs)[0])(weights))
    packed_gap = 0.0
    for row, outputs in enumerate(alone_outputs):
        start = 0
        for output in outputs:
            gap = np.abs(packed_out[row, start:start + len(output)] - output).max()
            packed_gap, start = max(packed_gap, float(gap)), start + len(output)
    return {
        "routed": routed,
        "real_tokens": float(np.abs(splash_out - keras_out)[real].max()),
        "scale": float(np.abs(keras_out).max()),
        "padding": float(np.abs(splash_out - keras_out)[~real].max()),
        "packed_examples": packed_gap,
        "gradients": max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))
                         for a, b in zip(splash_grads, keras_grads)),
    }


gemma3 = keras_hub.models.Gemma3Backbone(
    image_size=None, num_layers=6, head_dim=16, use_post_ffw_norm=True, use_post_attention_norm=True,
    use_sliding_window_attention=True, sliding_window_size=window, **SMALL)
figures = {
    "llama": compare(keras_hub.models.LlamaBackbone(num_layers=2, **SMALL)),
    "qwen3": compare(keras_hub.models.Qwen3Backbone(num_layers=2, head_dim=16, **SMALL)),
    "gemma3": compare(gemma3),
    # a sliding layer, a global one with heads of its own size and partial rotary positions
    # (Gemma 3's six are its backbone's fixed pattern; Gemma 4 takes layer_types)
    "gemma4": compare(keras_hub.models.Gemma4Backbone(
        image_size=None, num_layers=2, layer_types=["sliding_attention", "full_attention"], head_dim=16,
        global_head_dim=32, sliding_window_size=window, global_rope_partial_rotary_factor=0.25, **SMALL)),
    # a Gated DeltaNet layer (the toolkit's rule, as a run computes it), one gated full
    # attention layer with a quarter of each head rotated
    "qwen3_5": compare(segments_routed(keras_hub.models.Qwen3_5Backbone(
        num_layers=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        sliding_window_size=None, **SMALL))),
}
# The kernel's window against keras-hub's own, on a causal mask of ones: the same keys.
sliding = next(layer for layer in gemma3._flatten_layers()
               if type(layer).__name__ == "CachedGemma3Attention" and layer.use_sliding_window_attention)
causal = np.tril(np.ones((1, length, length), bool))
keras_window = np.asarray(sliding._mask_sliding_window(causal))[0]
cpu_cluster = Cluster(strategy=None, kind="jax", num_hosts=1, host_index=0, num_replicas=4,
                      device_kind="8 x cpu", engine="jax", mesh=SIZES,
                      device_mesh=mesh)
print("SPLASH " + json.dumps({
    **figures,
    "window_mask_same": bool((splash_attention.mask(length, window)[:, :] == keras_window).all()),
    "window_keys": int(keras_window[-1].sum()),
    "routed_on_cpu": splash_attention.route(keras_hub.models.LlamaBackbone(num_layers=1, **SMALL),
                                            cpu_cluster),
}), flush=True)
