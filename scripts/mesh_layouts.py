"""What each way of laying a mesh on a TPU slice costs: ring hops per axis and the planner's
communication time, from libtpu's description of the slice (no TPU needed). Prints JSON.

    python scripts/mesh_layouts.py --tpu=v5litepod-16 --config=configs/lm_stdlib.py
    python scripts/mesh_layouts.py --tpu=v4-128 --config=configs/lm_stdlib.py:1b --mesh=4,8,2

Layouts compared, each mesh of the slice given by --mesh (data,fsdp,model, or
data,fsdp,expert,model; default: data alone, fsdp alone, data with model=2
or 4, data with fsdp=4):

- `jax`: the toolkit's, JAX's `create_device_mesh` along the chip torus
  (splitting a physical side between axes where it must);
- `contiguous`: the same with `contiguous_submeshes=True`, each host's
  chips one block of the mesh (what the toolkit required of a layout before
  it followed the chip order), where JAX can build it;
- `by_host`: hosts in turn, each host's chips by id, as CPU devices sorted
  by host are laid out.

For each: the mean links between ring neighbours along `data`, `fsdp`,
`expert`, `model` and the batch (`data`, `fsdp` and `expert` together), 1.0
being neighbouring chips (`planning.network.ring_hops`); and the planner's
time inside the slice for the config's model on that mesh (`python -m tpu_keras.plan`),
each collective's bytes at the published ICI bandwidth times the hops of
the axis they cross (the planner itself counts 1.0: `ideal_ici_seconds`).
"""

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from tpu_keras import objectives
from tpu_keras.cluster import libtpu, topology
from tpu_keras.errors import UserError
from tpu_keras.planning import network
from tpu_keras.parallelism import mesh as mesh_lib
from tpu_keras.planning import slice_plan

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/lm_stdlib.py")
_TPU = flags.DEFINE_string("tpu", "v5litepod-16", "One TPU slice type.")
_MESH = flags.DEFINE_multi_string("mesh", [], "data,fsdp,model (or data,fsdp,expert,context,model) of one "
                                  "mesh (repeatable).")

# The collectives of the planner's sent-per-step, by the mesh axis each crosses.
_AXIS_OF = {"fsdp_all_gather": "fsdp", "fsdp_reduce_scatter": "fsdp",
            "gradient_all_reduce": "batch", "model_all_reduce": "model"}
_AXES = {**{axis: (i,) for i, axis in enumerate(mesh_lib.AXES)},
         "batch": tuple(mesh_lib.AXES.index(axis) for axis in mesh_lib.BATCH_AXES)}


def layouts(chips, shape):
    """{name: grid or None}: the three layouts of `shape` (the sizes of `mesh_lib.AXES`) on
    `chips`."""
    import numpy as np
    from jax.experimental import mesh_utils
    found = {"jax": mesh_lib.device_grid(chips, 1, *shape)}
    try:
        found["contiguous"] = mesh_utils.create_device_mesh(
            shape, devices=chips, contiguous_submeshes=True, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError):
        found["contiguous"] = None
    by_host = sorted(chips, key=lambda d: (d.process_index, d.id))
    found["by_host"] = np.array(by_host, dtype=object).reshape(shape)
    return found


def default_meshes(devices):
    shapes = [(devices, 1, 1), (1, devices, 1)]
    shapes += [(devices // m, 1, m) for m in (2, 4) if devices % m == 0 and devices > m]
    shapes += [(devices // 4, 4, 1)] if devices % 4 == 0 and devices > 4 else []
    return [_with_expert(shape) for shape in shapes]


def _with_expert(shape):
    """(data, fsdp, expert, context, model) of a (data, fsdp, model) with expert and context 1;
    a 5-tuple as it is."""
    return shape if len(shape) == len(mesh_lib.AXES) else (shape[0], shape[1], 1, 1, shape[2])


def main(argv):
    del argv
    slices, found = topology.parse_tpu(_TPU.value)
    if slices != 1:
        raise app.UsageError("one slice: ring hops are inside a slice (slices meet over the DCN)")
    config = _CONFIG.value
    objectives.check(config)
    config.engine = "jax"
    chips = libtpu.devices(_TPU.value)
    shapes = ([_with_expert(tuple(map(int, m.split(",")))) for m in _MESH.value]
              or default_meshes(len(chips)))
    results = []
    for shape in shapes:
        config.mesh = {"slices": 1, **dict(zip(mesh_lib.AXES, shape))}
        config.train.batch_size = max(config.train.batch_size, mesh_lib.batch_splits(config.mesh))
        try:
            plan = slice_plan.plan(config, _TPU.value)
        except UserError as error:  # the model's layout rules cannot take this mesh
            results.append({"mesh": dict(zip(mesh_lib.AXES, shape)), "skipped": str(error)})
            continue
        sent, ideal = plan["sent_per_step"], plan["network"]["ici_seconds"]
        row = {"mesh": dict(zip(mesh_lib.AXES, shape)), "ideal_ici_seconds": ideal, "layouts": {}}
        for name, grid in layouts(chips, shape).items():
            if grid is None:
                row["layouts"][name] = None
                continue
            hops = {axis: network.ring_hops(grid, axes, found.chip_shape, found.wraparound)
                    for axis, axes in _AXES.items()}
            weighted = sum(sent[key] * hops[axis] for key, axis in _AXIS_OF.items())
            unweighted = sum(sent[key] for key in _AXIS_OF)
            row["layouts"][name] = {
                "ring_hops": {axis: round(value, 3) for axis, value in hops.items()},
                "ici_seconds": ideal * weighted / unweighted if unweighted else 0.0}
        results.append(row)
    print(json.dumps({"tpu": _TPU.value, "topology": found.topology_name,
                      "wraparound": found.wraparound, "model": config.model.name,
                      "meshes": results}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"))
    app.run(main)
