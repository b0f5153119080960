"""keras-hub's Llama with splash attention against its own attention, on 8 fake devices.

    python tests/helpers/splash_probe.py

The kernel runs in Pallas's interpreter (a CPU has no TPU kernels); its
numbers are the TPU kernel's. A Llama (grouped-query, 4 heads over 2 key
heads, 256 tokens: two of the kernel's tiles) under a data=2 x fsdp=2 x
model=2 distribution computes its outputs and the gradients of a loss that
weighs only real tokens, once with keras-hub's attention and once routed
through `models.splash_attention`, on a batch with right and left padding.
Then rows that pack examples apart (`models.segments`: each ends with the
end token, and the kernel takes each token's example as its segment id) go
through the kernel, against each example run alone through keras-hub's own
attention. Prints one line, `SPLASH {json}`: how many layers were routed, the
largest differences at real tokens and in the gradients, the largest
difference at padding (which the kernel may change), the largest difference
of the packed examples' outputs, and what `route` does on CPU devices.
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

mesh = keras.distribution.DeviceMesh((2, 2, 2), ("data", "fsdp", "model"), jax.devices())
keras.distribution.set_distribution(keras.distribution.ModelParallel(
    layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="data"))
backbone = keras_hub.models.LlamaBackbone(
    vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=64,
    intermediate_dim=128)
rows, length = 8, 256
rng = np.random.default_rng(0)
padding = np.ones((rows, length), "int32")
padding[1, 200:] = 0  # right padding
padding[3, 7:] = 0
padding[5, :30] = 0  # left padding
batch = {"token_ids": rng.integers(0, 64, (rows, length)).astype("int32"), "padding_mask": padding}
weights = [v.value for v in backbone.trainable_variables]


def outputs_and_gradients():
    def loss(w):
        out = backbone.stateless_call(w, [], batch)[0]
        return (out.astype("float32") ** 2 * padding[..., None]).sum(), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(weights)
    return np.asarray(out), [np.asarray(g) for g in grads]


def packed_rows():
    """Four rows (the batch axes split 4 ways) of whole examples, each ended by the end token 0."""
    lengths = [(100, 80, 76), (7, 150, 99), (256,), (3, 3, 250)]
    examples = [[np.append(rng.integers(1, 64, n - 1), 0).astype("int32") for n in row] for row in lengths]
    return examples, np.stack([np.concatenate(row) for row in examples])


def alone(example):
    """keras-hub's output for one example alone, right-padded to the row length."""
    tokens, mask = np.zeros((1, length), "int32"), np.zeros((1, length), "int32")
    tokens[0, :len(example)], mask[0, :len(example)] = example, 1
    return np.asarray(backbone({"token_ids": tokens, "padding_mask": mask}))[0, :len(example)]


examples, packed = packed_rows()
alone_outputs = [[alone(example) for example in row] for row in examples]
keras_out, keras_grads = outputs_and_gradients()
routed = splash_attention.route_layers(backbone, interpret=True, shortest=256)
splash_out, splash_grads = outputs_and_gradients()
segments.keep_examples_apart(backbone)
ids = segments.example_ids(packed, 0)
with segments.current(ids):  # traced inside: the kernel's segments are the examples
    packed_out = np.asarray(jax.jit(lambda w: backbone.stateless_call(
        w, [], {"token_ids": packed, "padding_mask": np.ones_like(packed)})[0])(weights))
packed_gap, start = 0.0, None
for row, outputs in enumerate(alone_outputs):
    start = 0
    for output in outputs:
        packed_gap = max(packed_gap, float(np.abs(packed_out[row, start:start + len(output)] - output).max()))
        start += len(output)
real = padding.astype(bool)
cpu_cluster = Cluster(strategy=None, kind="jax", num_hosts=1, host_index=0, num_replicas=4,
                      device_kind="8 x cpu", engine="jax", mesh={"data": 2, "fsdp": 2, "model": 2},
                      device_mesh=mesh)
print("SPLASH " + json.dumps({
    "routed": routed,
    "real_tokens": float(np.abs(splash_out - keras_out)[real].max()),
    "scale": float(np.abs(keras_out).max()),
    "padding": float(np.abs(splash_out - keras_out)[~real].max()),
    "packed_examples": packed_gap,
    "gradients": max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))
                     for a, b in zip(splash_grads, keras_grads)),
    "routed_on_cpu": splash_attention.route(keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=64, intermediate_dim=128), cpu_cluster),
}), flush=True)
