"""What each of 8 fake devices holds while a Llama preset loads under an fsdp=8 mesh.

    python tests/helpers/load_memory_probe.py PRESET_DIR

Saves a Llama backbone as a keras-hub preset, then loads it twice on the jax
engine with the toolkit's distribution set for data=1 x fsdp=8: by keras-hub
alone (`LlamaBackbone.from_preset`, Keras's own assignment) and by the
toolkit (`build_model` with `model.preset`). Around every weight assignment
it sums the bytes of each device's shards of the live arrays
(`jax.live_arrays()`) from the call of `from_preset` to its return, and
prints one JSON line: per loader, each device's peak above what it held
before the load and what it holds at the end (the backbone's own shards),
the largest replicated weight's bytes, the largest difference from the
saved weights, and how many programs XLA compiled during the load (none
for initial values the preset then overwrites). And `unloaded`: a Dense
layer made in the toolkit's loading scope with only its kernel written,
whose bias must come out as its initializer's ones.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import gc
import json
import sys

preset_dir = sys.argv[1]

from tpu_keras.cluster import engine  # noqa: E402

engine.select("jax", virtual_devices=8)

import jax  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from keras.src.backend.jax import core  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras.training.setup import build_model  # noqa: E402

sys.path.insert(0, "configs")
import llama_stdlib  # noqa: E402

DEVICES = jax.devices()


def held() -> list:
    """Bytes of live arrays' shards on each device."""
    total = dict.fromkeys(DEVICES, 0)
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            total[shard.device] += shard.data.nbytes
    return [total[device] for device in DEVICES]


peak = None
compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *_, **__: compiles.__setitem__(0, compiles[0] + (
        event == "/jax/core/compile/backend_compile_duration")))
direct_assign = core.JaxVariable._direct_assign


def sampled_assign(variable, value):  # the whole incoming value is alive here
    global peak
    if peak is not None:
        peak = [max(p, h) for p, h in zip(peak, held())]
    direct_assign(variable, value)
    if peak is not None:
        peak = [max(p, h) for p, h in zip(peak, held())]


core.JaxVariable._direct_assign = sampled_assign
from_preset = keras_hub.models.LlamaBackbone.from_preset.__func__
loads = []


def measured_from_preset(cls, *args, **kwargs):
    """The backbone's load, whoever calls it, measured from entry to return."""
    global peak
    gc.collect()
    before = held()
    peak = list(before)
    compiled = compiles[0]
    backbone = from_preset(cls, *args, **kwargs)
    compiled = compiles[0] - compiled
    gc.collect()
    after = held()
    replicated = max(v.value.nbytes for v in backbone.weights
                     if v.value.sharding.is_fully_replicated)
    loads.append({"peak": [p - b for p, b in zip(peak, before)],
                  "end": [a - b for a, b in zip(after, before)], "largest_replicated": replicated,
                  "compiles": compiled})
    peak = None
    loads[-1]["difference"] = max(float(np.abs(np.asarray(v.value) - saved[v.path]).max())
                                  for v in backbone.weights)  # 0: the preset's weights
    return backbone


keras_hub.models.LlamaBackbone.from_preset = classmethod(measured_from_preset)

config = llama_stdlib.get_config("tiny")
config.model.update(vocabulary_size=4096, hidden_dim=128, intermediate_dim=512, num_layers=2,
                    num_query_heads=4, num_key_value_heads=2)
config.mesh.update(data=1, fsdp=8, model=1)
architecture = {k: v for k, v in config.model.items()
                if k not in ("name", "context_length", "layout_map")}
backbone = keras_hub.models.LlamaBackbone(**architecture)
backbone.save_to_preset(preset_dir)
saved = {v.path: np.asarray(v.value) for v in backbone.weights}
del backbone
config.model.preset = preset_dir
cluster = tpu_keras.connect(config.cluster, engine="jax", mesh=config.mesh)

model = build_model(config, cluster)  # sets the distribution it loads under
del model
keras_hub.models.LlamaBackbone.from_preset(preset_dir)  # keras-hub alone, the same distribution

from tpu_keras.parallelism import host_placement  # noqa: E402

with keras.name_scope("decoder"):
    dense = keras.layers.Dense(64, bias_initializer="ones", name="ffw")
    with host_placement.placed_from_host(loading=True):
        dense.build((None, 64))
        kernel = np.random.default_rng(0).normal(size=(64, 64)).astype("float32")
        dense.kernel.assign(kernel)  # the bias is not loaded
unloaded = {"kernel": float(np.abs(np.asarray(dense.kernel.value) - kernel).max()),
            "bias": np.asarray(dense.bias.value).tolist(),
            "bias_sharding": str(dense.bias.value.sharding.spec)}
print("LOAD " + json.dumps({"toolkit": loads[0], "keras_hub": loads[1], "unloaded": unloaded,
                            "distribution": type(keras.distribution.distribution()).__name__}),
      flush=True)
