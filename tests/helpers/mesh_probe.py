"""Trains a config's model a few steps on jax meshes and reports what each device holds.

    python tests/helpers/mesh_probe.py DATAxMODEL[,DATAxMODEL...] DATA_DIR INIT.npz VARIANT [MODEL_JSON] [STEPS]

Runs in its own process (JAX fixes its device count at start-up) with
DATA x MODEL fake CPU devices (the same count for every mesh listed, which
then share one start-up; a mesh of 1x1 among them runs on the first device
alone, `cluster.strategy='one_device'`), on `configs/lm_stdlib.py:VARIANT` ('' or 'tiny';
'llama_stdlib:tiny' names another config file) with the model arguments in
MODEL_JSON changed. The first run of a series
saves its initial weights to INIT.npz; later runs load them, so losses
compare across meshes. Prints one JSON line per mesh: per-step losses, each
variable's sharding and shard shape, and the bytes device 0 holds.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json
import sys

# DATAxMODEL, or DATAxFSDPxMODEL.
meshes = [(lambda sizes: (sizes[0], 1, sizes[1]) if len(sizes) == 2 else tuple(sizes))(
    list(map(int, m.split("x")))) for m in sys.argv[1].split(",")]
data_dir, init_path = sys.argv[2], sys.argv[3]
config_name, _, variant = sys.argv[4].rpartition(":")
config_name, variant = config_name or "lm_stdlib", variant or None
model_overrides = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
steps = int(sys.argv[6]) if len(sys.argv) > 6 else 5
devices = {d * f * m for d, f, m in meshes if (d, f, m) != (1, 1, 1)} or {1}
assert len(devices) == 1, f"every mesh must use the same devices, not {sorted(devices)}"

from tpu_keras.cluster import engine  # noqa: E402

engine.select("jax", virtual_devices=devices.pop())

import jax  # noqa: E402
import keras  # noqa: E402

from probe_run import train_from_shared_init  # noqa: E402
from tpu_keras import models  # noqa: E402

sys.path.insert(0, "configs")
config_module = __import__(config_name)  # noqa: E402

device0 = jax.devices()[0]


def described(variable):
    array = variable.value
    shard = next(s for s in array.addressable_shards if s.device == device0)
    spec = getattr(array.sharding, "spec", ())  # one device: a SingleDeviceSharding
    return {"spec": [list(a) if isinstance(a, tuple) else a for a in spec],
            "shape": list(array.shape), "shard_shape": list(shard.data.shape),
            "bytes_device0": int(shard.data.nbytes)}


def probe(data_axis, fsdp_axis, model_axis):
    keras.backend.clear_session()  # names as in a fresh process: 'adam_w', not 'adam_w_1'
    config = config_module.get_config(variant)
    config.data.data_dir = data_dir
    config.model.update(model_overrides)
    config.mesh.update(data=data_axis, fsdp=fsdp_axis, model=model_axis)
    if (data_axis, fsdp_axis, model_axis) == (1, 1, 1):  # one device of the process's
        config.cluster.strategy = "one_device"
    model, history, cluster = train_from_shared_init(config, "jax", init_path, steps)

    placer = models.registry.placer(config.model, config.layout, cluster.mesh)
    expected = {p.path: list(p.axes) for p in placer.check(model.weights)}
    weights = {v.path: described(v) for v in model.weights}
    optimizer = {v.path: described(v) for v in model.optimizer.variables}
    print("PROBE " + json.dumps({
        "mesh": cluster.mesh,
        "losses": [float(x) for x in history.history["loss"]],
        "weights": weights,
        "expected": expected,
        "optimizer": optimizer,
        "param_bytes_device0": sum(w["bytes_device0"] for w in weights.values()),
        "optimizer_bytes_device0": sum(o["bytes_device0"] for o in optimizer.values()),
    }), flush=True)


for mesh in meshes:
    probe(*mesh)
