"""Saves a small Llama backbone as a keras-hub preset, then builds the toolkit's model from it.

    python tests/helpers/hub_preset.py ENGINE PRESET_DIR

Prints one JSON line: the loss on one batch of the saved backbone itself,
of the toolkit's model built from `model.preset=PRESET_DIR` (equal when
the weights were really loaded), and of the same model built from scratch
(different: a check that can fail).
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json
import sys

engine_name, preset_dir = sys.argv[1], sys.argv[2]

from tpu_keras.cluster import engine  # noqa: E402

engine.select(engine_name)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras.training.setup import build_model  # noqa: E402

sys.path.insert(0, "configs")
import llama_stdlib  # noqa: E402

config = llama_stdlib.get_config("tiny")
architecture = {k: v for k, v in config.model.items()
                if k not in ("name", "context_length", "layout_map")}
tokens = np.random.default_rng(0).integers(0, 256, (4, 65)).astype("int32")
inputs, targets = tokens[:, :-1], tokens[:, 1:]
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

keras.utils.set_random_seed(1)
saved = keras_hub.models.LlamaBackbone(**architecture)
saved.save_to_preset(preset_dir)
task = keras_hub.models.LlamaCausalLM(backbone=saved, preprocessor=None, compile=False)
saved_loss = loss(targets, task({"token_ids": inputs, "padding_mask": np.ones_like(inputs)}))

cluster = tpu_keras.connect(config.cluster, engine=engine_name, mesh=config.mesh)
keras.utils.set_random_seed(2)
scratch_loss = loss(targets, build_model(config, cluster)(inputs))
config.model.preset = preset_dir
loaded_loss = loss(targets, build_model(config, cluster)(inputs))
print("PRESET " + json.dumps({name: float(keras.ops.convert_to_numpy(value)) for name, value in
                              (("saved", saved_loss), ("loaded", loaded_loss),
                               ("scratch", scratch_loss))}), flush=True)
