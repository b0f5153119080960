"""Examples packed apart in a row (`tpu_keras.models.segments`) against each example alone.

    python tests/helpers/segments_probe.py ENGINE

The gpt builder (learned positions, which restart per example) and keras-hub's
Llama 3 (rotary positions), each built as a run builds it with
`model.example_end_token=0` (tf: one device; jax: a mesh of data 2 x model 2
on 4 devices), read two rows of three whole examples each, every one ending
with the end token. Each example then runs alone, padded after its end; its
logits must be the packed row's at its tokens. The same rows through the
same weights as one stream (no end token given) must differ. Prints one
line, `SEGMENTS {json}`: per model, the largest difference at real tokens,
relative to the logits' scale, and the stream's.
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
from tpu_keras.training.setup import build_model  # noqa: E402

LENGTH = 24
MODELS = {
    "gpt": dict(name="gpt", vocab_size=64, context_length=LENGTH, width=32, depth=2, num_heads=4),
    "llama": dict(name="keras_hub:Llama3CausalLM", vocabulary_size=64, num_layers=2, num_query_heads=4,
                  num_key_value_heads=2, hidden_dim=32, intermediate_dim=48, context_length=LENGTH),
}
rng = np.random.default_rng(0)
examples = [[rng.integers(1, 64, n - 1).tolist() + [0] for n in lengths] for lengths in ((9, 5, 10), (3, 17, 4))]
rows = np.array([sum(row, []) for row in examples], "int32")


def build(model, end_token):
    config = defaults()
    config.engine = engine_name
    config.model = dict(MODELS[model], example_end_token=end_token)
    config.mesh = dict(data=2, fsdp=1, model=2) if engine_name == "jax" else dict(data=-1, fsdp=1, model=1)
    cluster = tpu_keras.connect(config.cluster, engine=engine_name, mesh=config.mesh)
    keras.utils.set_random_seed(0)
    return build_model(config, cluster)


result = {}
for name in MODELS:
    packed_model = build(name, 0)
    packed = keras.ops.convert_to_numpy(packed_model.predict(rows, verbose=0))
    alone = []
    for r, row in enumerate(examples):
        start = 0
        for example in row:
            tokens = np.ones((2, LENGTH), "int32")  # two rows: the mesh splits the batch in two
            tokens[:, :len(example)] = example
            out = keras.ops.convert_to_numpy(packed_model.predict(tokens, verbose=0))[0, :len(example)]
            alone.append(float(np.abs(out - packed[r, start:start + len(example)]).max()))
            start += len(example)
    stream_model = build(name, -1)
    stream_model.set_weights(packed_model.get_weights())
    stream = keras.ops.convert_to_numpy(stream_model.predict(rows, verbose=0))
    scale = float(np.abs(packed).max())
    result[name] = {"alone": max(alone) / scale, "stream": float(np.abs(stream - packed).max()) / scale}
print("SEGMENTS " + json.dumps(result), flush=True)
