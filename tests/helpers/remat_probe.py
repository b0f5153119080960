"""Trains 5 steps with and without rematerialisation (jax, one device): configs/lm_stdlib.py's
gpt with remat 'none' and 'activations', configs/llama_stdlib.py's keras-hub Llama with 'none'
and 'blocks'.

    python tests/helpers/remat_probe.py DATA_DIR

The settings of one model start from the same initial weights and read the
same batches. Prints one JSON line per model and setting: its losses, and
XLA's temporary bytes for the compiled gradient of one batch.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json
import sys

from tpu_keras.cluster import engine

engine.select("jax")

import keras  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras import data  # noqa: E402
from tpu_keras.planning import activations  # noqa: E402
from tpu_keras.models import registry  # noqa: E402
from tpu_keras.training.setup import build_model  # noqa: E402

sys.path.insert(0, "configs")
import llama_stdlib  # noqa: E402
import lm_stdlib  # noqa: E402

weights = None
for name, get_config, remat in (("gpt", lm_stdlib.get_config, "none"),
                                ("gpt", lm_stdlib.get_config, "activations"),
                                ("llama", llama_stdlib.get_config, "none"),
                                ("llama", llama_stdlib.get_config, "blocks")):
    keras.backend.clear_session()
    config = get_config()
    config.data.data_dir = sys.argv[1]
    config.train.update(steps_per_execution=1, remat=remat)
    cluster = tpu_keras.connect(config.cluster, engine="jax", mesh=config.mesh)
    keras.utils.set_random_seed(0)
    model = build_model(config, cluster)
    if remat == "none":
        weights = model.get_weights()
    model.set_weights(weights)
    builder, _ = registry.get(config.model)
    temp = activations.step_temp_bytes(model, builder.loss(), config.train.batch_size)
    train_data, _ = data.build(config.data, cluster, config.train.batch_size, training=True)
    history = model.fit(train_data, steps_per_epoch=1, epochs=5, verbose=0)
    print("REMAT " + json.dumps({"model": name, "remat": remat, "losses": history.history["loss"],
                                 "temp_bytes": int(temp)}), flush=True)
