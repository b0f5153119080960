"""The device mesh: `config.mesh = {'data': -1, 'fsdp': F, 'model': M}` resolved against devices.

Three named axes. `data` and `fsdp` both split the batch; `fsdp` also
splits every large weight (and its gradient and optimizer state), which
each layer all-gathers when it runs (fully-sharded data parallelism);
`model` splits weights by the builder's layout rules (tensor parallelism,
see `parallelism.rules`). -1 means "all the devices the other axes leave".
On the tf engine `fsdp` and `model` must be 1: Keras 3's TensorFlow backend
ignores layouts (keras-team/keras#18473).
"""

import math

from tpu_keras.errors import UserError

AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")  # the axes the batch is split over
_DEFAULTS = {"data": -1, "fsdp": 1, "model": 1}


def check(mesh_config) -> dict[str, int]:
    """The mesh's axis sizes, or a one-line error for sizes that no device count fits."""
    given = dict(mesh_config or {})
    given.pop("slices", None)  # not an axis of the device mesh: the slices extend data
    unknown = sorted(set(given) - set(AXES))
    if unknown:
        raise UserError(f"mesh axis {unknown[0]!r} is not one of {AXES}; the mesh is "
                        "{'data': -1, 'fsdp': F, 'model': M}")
    mesh = {axis: int(given.get(axis, _DEFAULTS[axis])) for axis in AXES}
    wildcards = [axis for axis, size in mesh.items() if size == -1]
    if len(wildcards) > 1 or any(size == 0 or size < -1 for size in mesh.values()):
        raise UserError(f"mesh={mesh} is not valid: give each axis a positive size, "
                        "or -1 on one axis for the devices left over")
    return mesh


def batch_splits(mesh: dict[str, int]) -> int:
    """How many ways the batch is split: data x fsdp."""
    return math.prod(mesh.get(axis, 1) for axis in BATCH_AXES)


def resolve(mesh_config, num_devices: int, engine: str = "jax") -> dict[str, int]:
    """Returns `{'data': D, 'fsdp': F, 'model': M}` with D x F x M == num_devices, or a one-line error."""
    mesh = check(mesh_config)
    wildcards = [axis for axis, size in mesh.items() if size == -1]
    fixed = math.prod(size for size in mesh.values() if size != -1)
    if wildcards:
        if num_devices % fixed:
            raise UserError(f"mesh={mesh} does not fit {num_devices} devices: {fixed} does not "
                            f"divide {num_devices}; use an axis size that divides it")
        mesh[wildcards[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise UserError(f"mesh={mesh} needs {fixed} devices but there are {num_devices}; "
                        "set mesh.data=-1 to use them all")
    for axis in ("model", "fsdp"):
        if engine == "tf" and mesh[axis] > 1:
            raise UserError(f"mesh.{axis}={mesh[axis]} needs the jax engine (--config.engine=jax): "
                            "Keras 3's TensorFlow backend ignores layouts (keras-team/keras#18473)")
    return mesh


def describe(mesh: dict[str, int]) -> str:
    """'data=4 x model=2', with fsdp named only when it splits something."""
    return " x ".join(f"{axis}={mesh[axis]}" for axis in AXES if axis != "fsdp" or mesh[axis] > 1)


def input_pipelines(device_grid, local_devices) -> tuple[int, int]:
    """How many distinct input pipelines feed the mesh, and which one this process runs.

    `device_grid` is the (batch rows, model) array of devices: the mesh with
    `data` and `fsdp` flattened into rows. A process feeds the batch rows its
    devices hold. When every process holds
    its own block of rows (the usual case: the model axis stays within a
    host) there is one pipeline per process; processes that share rows (a
    model axis across hosts) share a pipeline and read the same examples.
    """
    local = set(local_devices)
    rows_of_process = tuple(sorted({i for i, row in enumerate(device_grid) for d in row if d in local}))
    rows = len(rows_of_process)
    if rows == 0 or rows_of_process != tuple(range(rows_of_process[0], rows_of_process[0] + rows)) \
            or rows_of_process[0] % rows or len(device_grid) % rows:
        raise UserError(f"this process's devices hold data rows {rows_of_process} of the mesh, "
                        "not one aligned block; use a mesh.model that divides the devices per host")
    return len(device_grid) // rows, rows_of_process[0] // rows
