"""The device mesh: `config.mesh = {'slices': S, 'data': -1, 'fsdp': F, 'model': M}` resolved
against devices.

Three named axes inside a slice. `data` and `fsdp` both split the batch;
`fsdp` also splits every large weight (and its gradient and optimizer
state), which each layer all-gathers when it runs (fully-sharded data
parallelism); `model` splits weights by the builder's layout rules (tensor
parallelism, see `parallelism.rules`). -1 means "all the devices the other
axes leave". On the tf engine `fsdp` and `model` must be 1: Keras 3's
TensorFlow backend ignores layouts (keras-team/keras#18473).

`slices` (default 1) is data parallelism across TPU slices, which only the
data-center network (DCN) joins, far slower than the chip interconnect
inside a slice. So slices carry whole replicas of the weights and exchange
only the gradients' all-reduce: `data`, `fsdp` and `model` are each
slice's shape, there are `slices x data x fsdp x model` devices, and the
device mesh Keras sees keeps three axes, slices folded into the outer part
of `data` (`device_grid`). A layout rule may not name `slices`, nor `data`
when it spans slices.
"""

import math

from tpu_keras.errors import UserError

AXES = ("data", "fsdp", "model")  # the device mesh's axes, as Keras and JAX name them
BATCH_AXES = ("data", "fsdp")  # the axes the batch is split over
SLICES = "slices"  # data parallelism across slices: folded into the device mesh's `data`
_DEFAULTS = {SLICES: 1, "data": -1, "fsdp": 1, "model": 1}
_SCHEMA = "{'slices': S, 'data': -1, 'fsdp': F, 'model': M}"


def check(mesh_config, engine: str = "jax") -> dict[str, int]:
    """The mesh's axis sizes, or a one-line error for sizes that no device count fits (or
    that `engine` cannot run)."""
    given = dict(mesh_config or {})
    unknown = sorted(set(given) - set(_DEFAULTS))
    if unknown:
        raise UserError(f"mesh axis {unknown[0]!r} is not one of {tuple(_DEFAULTS)}; the mesh is "
                        f"{_SCHEMA}")
    mesh = {axis: int(given.get(axis, default)) for axis, default in _DEFAULTS.items()}
    if mesh[SLICES] < 1:
        raise UserError(f"mesh.slices={mesh[SLICES]} is not valid: give the number of TPU slices "
                        "the run spans (1 for one slice)")
    if engine == "tf" and mesh[SLICES] > 1:
        raise UserError(f"mesh.slices={mesh[SLICES]} needs the jax engine (--config.engine=jax): "
                        "TensorFlow's TPUStrategy drives one slice from one client, and "
                        "tf.distribute has no mesh across slices")
    wildcards = [axis for axis, size in mesh.items() if size == -1]
    if len(wildcards) > 1 or any(size == 0 or size < -1 for size in mesh.values()):
        raise UserError(f"mesh={mesh} is not valid: give each axis a positive size, "
                        "or -1 on one axis for the devices left over")
    return mesh


def batch_splits(mesh: dict[str, int]) -> int:
    """How many ways the batch is split: slices x data x fsdp."""
    return mesh.get(SLICES, 1) * math.prod(mesh.get(axis, 1) for axis in BATCH_AXES)


def resolve(mesh_config, num_devices: int, engine: str = "jax") -> dict[str, int]:
    """Returns `{'slices': S, 'data': D, 'fsdp': F, 'model': M}` with S x D x F x M ==
    num_devices (D, F, M: each slice's shape), or a one-line error."""
    mesh = check(mesh_config, engine)
    slices = mesh[SLICES]
    if num_devices % slices:
        raise UserError(f"mesh.slices={slices} does not divide the {num_devices} devices; "
                        f"set mesh.slices to the number of slices the devices are in")
    per_slice = num_devices // slices
    inside = {axis: mesh[axis] for axis in AXES}
    wildcards = [axis for axis, size in inside.items() if size == -1]
    fixed = math.prod(size for size in inside.values() if size != -1)
    where = f"{per_slice} devices per slice" if slices > 1 else f"{num_devices} devices"
    if wildcards:
        if per_slice % fixed:
            raise UserError(f"mesh={mesh} does not fit {where}: {fixed} does not "
                            f"divide {per_slice}; use an axis size that divides it")
        mesh[wildcards[0]] = per_slice // fixed
    elif fixed != per_slice:
        raise UserError(f"mesh={mesh} needs {fixed * slices} devices but there are {num_devices}; "
                        "set mesh.data=-1 to use them all")
    for axis in ("model", "fsdp"):
        if engine == "tf" and mesh[axis] > 1:
            raise UserError(f"mesh.{axis}={mesh[axis]} needs the jax engine (--config.engine=jax): "
                            "Keras 3's TensorFlow backend ignores layouts (keras-team/keras#18473)")
    return mesh


def describe(mesh: dict[str, int]) -> str:
    """'data=4 x model=2', with slices and fsdp named only when they split something."""
    named = [SLICES] * (mesh.get(SLICES, 1) > 1) + [a for a in AXES if a != "fsdp" or mesh[a] > 1]
    return " x ".join(f"{axis}={mesh[axis]}" for axis in named)


def device_grid(devices, slices: int, data: int, fsdp: int, model: int):
    """The devices as a `(slices * data, fsdp, model)` array: rows `s * data` to
    `(s + 1) * data - 1` are slice `s`, each slice a `(data, fsdp, model)` block.

    On a TPU (devices carry `slice_index`), JAX's own helpers lay each slice out
    by its physical topology (`mesh_utils.create_device_mesh`: the last axes,
    where collectives are most frequent, on neighbouring chips) and put slices
    on the outer data axis (`create_hybrid_device_mesh` with a DCN shape of
    `(slices, 1, 1)`); the number of slices must be the devices' own. Elsewhere
    (CPU, fake devices) the devices, ordered by process then id, are cut into
    `slices` equal blocks: the launcher's slice `s` is its hosts
    `s * hosts_per_slice ...`, and on one process, consecutive device ids.
    """
    import numpy as np
    shape = (data, fsdp, model)
    if getattr(devices[0], "platform", "") == "tpu":
        from jax.experimental import mesh_utils
        found = sorted({getattr(d, "slice_index", 0) for d in devices})
        if len(found) != slices:
            raise UserError(f"the TPU devices are in {len(found)} slice(s) but mesh.slices={slices}; "
                            f"set --config.mesh.slices={len(found)}")
        if slices == 1:
            return mesh_utils.create_device_mesh(shape, devices=devices)
        return mesh_utils.create_hybrid_device_mesh(shape, (slices, 1, 1), devices=devices)
    ordered = sorted(devices, key=lambda d: (getattr(d, "process_index", 0), d.id))
    grid = np.empty(len(ordered), dtype=object)
    grid[:] = ordered
    return grid.reshape(slices * data, fsdp, model)


def slice_of_row(row: int, mesh: dict[str, int]) -> int:
    """The slice that holds row `row` of `device_grid`'s data axis."""
    return row // mesh["data"]


def input_pipelines(grid_rows, local_devices) -> tuple[int, int]:
    """How many distinct input pipelines feed the mesh, and which one this process runs.

    `grid_rows` is the (batch rows, model) array of devices: the mesh with
    `data` and `fsdp` flattened into rows. A process feeds the batch rows its
    devices hold. When every process holds
    its own block of rows (the usual case: the model axis stays within a
    host) there is one pipeline per process; processes that share rows (a
    model axis across hosts) share a pipeline and read the same examples.
    """
    local = set(local_devices)
    rows_of_process = tuple(sorted({i for i, row in enumerate(grid_rows) for d in row if d in local}))
    rows = len(rows_of_process)
    if rows == 0 or rows_of_process != tuple(range(rows_of_process[0], rows_of_process[0] + rows)) \
            or rows_of_process[0] % rows or len(grid_rows) % rows:
        raise UserError(f"this process's devices hold data rows {rows_of_process} of the mesh, "
                        "not one aligned block; use a mesh.model that divides the devices per host")
    return len(grid_rows) // rows, rows_of_process[0] // rows
