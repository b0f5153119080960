"""Trains a config's model 10 steps on one device of one engine, from saved initial weights.

    python tests/helpers/engine_probe.py ENGINE CONFIG[:VARIANT] DATA_DIR INIT.npz [OVERRIDES_JSON]

OVERRIDES_JSON is {"section": {"key": value}} merged into the config.

The first engine to run saves its initial weights to INIT.npz; the other
loads them, so both start equal and read the same batches. Prints one JSON
line: the per-step losses and gradient norms.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json
import sys

engine_name, spec, data_dir, init_path = sys.argv[1:5]

from tpu_keras.cluster import engine  # noqa: E402

engine.select(engine_name)

from probe_run import train_from_shared_init  # noqa: E402
from tpu_keras import cli  # noqa: E402

config = cli.load_config(spec)
config.data.data_dir = data_dir
for section, values in (json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}).items():
    config[section].update(values)
config.engine = engine_name
model, history, _ = train_from_shared_init(config, engine_name, init_path, steps=10)
print("ENGINE " + json.dumps({"engine": engine_name, "losses": history.history["loss"],
                              "grad_norms": history.history["grad_norm"]}), flush=True)
