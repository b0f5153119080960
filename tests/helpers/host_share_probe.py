"""A base quantized as it is read, by one process or by each of a launch's hosts.

    python tests/helpers/host_share_probe.py CHECKPOINT MODE/BLOCK...
    python -m tpu_keras.launch --hosts=2 --devices_per_host=2 -- \\
        python tests/helpers/host_share_probe.py CHECKPOINT MODE/BLOCK...

For each MODE/BLOCK (int8/0, int4/-1, int4/64), builds the toolkit's LoRA
model over the transformers checkpoint CHECKPOINT with `model.quantize=MODE`
(int4 in groups of BLOCK) on a fsdp 2 x model 2 mesh of 4 devices: one
process's, or two hosts' of two. Each process prints a line per model,
`PROBE {json}`: the sha256 of every weight's whole value (gathered from every
host) and the logits on a fixed batch. The log says what each host read
(`quantized.WhileLoading.report`).
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from tpu_keras.cluster import engine  # noqa: E402

launched = bool(os.environ.get("TPU_KERAS_COORDINATOR"))
engine.select("jax", virtual_devices=0 if launched else 4)

from absl import logging  # noqa: E402
import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras.config import defaults  # noqa: E402
from tpu_keras.training import setup  # noqa: E402

checkpoint, cases = sys.argv[1], sys.argv[2:]
logging.set_verbosity(logging.INFO)


def whole(value) -> np.ndarray:
    if jax.process_count() == 1:
        return np.asarray(value)
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


tokens = np.random.default_rng(0).integers(0, 300, (4, 32)).astype("int32")
cluster = None  # connected once: a process joins its run once
for case in cases:
    mode, block = case.split("/")
    config = defaults()
    config.engine = "jax"
    config.train.precision = "float32"
    config.model = dict(name="keras_hub:Llama3CausalLM", preset=checkpoint, context_length=32,
                        lora_rank=4, lora_targets="all-linear", quantize=mode,
                        quantize_block_size=int(block))
    config.mesh = dict(data=1, fsdp=2, model=2)
    cluster = cluster or tpu_keras.connect(config.cluster, engine="jax", mesh=config.mesh)
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)  # the LoRA factors' first values, on every host
    model = setup.build_model(config, cluster)
    digests = {weight.path: hashlib.sha256(whole(weight.value).tobytes()).hexdigest()[:16]
               for weight in model.weights}
    layout = keras.distribution.distribution().get_data_layout(tokens.shape).backend_layout
    batch = jax.make_array_from_callback(tokens.shape, layout, lambda index: tokens[index])
    logits = whole(model(batch))
    print("PROBE " + json.dumps({"case": case, "host": jax.process_index(), "hosts": jax.process_count(),
                                 "digests": digests, "logits": logits.tolist()}), flush=True)
    del model
