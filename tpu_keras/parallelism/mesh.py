"""The device mesh: `config.mesh = {'data': -1, 'model': M}` resolved against real devices.

Two named axes cover data, model and hybrid parallelism: `data` splits the
batch, `model` splits weights (see `parallelism.rules`). -1 means "all the
devices the other axis leaves". On the tf engine the model axis must be 1:
Keras 3's TensorFlow backend ignores layouts (keras-team/keras#18473).
"""

import math

from tpu_keras.errors import UserError

AXES = ("data", "model")


def check(mesh_config) -> dict[str, int]:
    """The mesh's axis sizes, or a one-line error for sizes that no device count fits."""
    mesh = {axis: int(dict(mesh_config or {}).get(axis, -1 if axis == "data" else 1)) for axis in AXES}
    wildcards = [axis for axis, size in mesh.items() if size == -1]
    if len(wildcards) > 1 or any(size == 0 or size < -1 for size in mesh.values()):
        raise UserError(f"mesh={mesh} is not valid: give each axis a positive size, "
                        "or -1 on one axis for the devices left over")
    return mesh


def resolve(mesh_config, num_devices: int, engine: str = "jax") -> dict[str, int]:
    """Returns `{'data': D, 'model': M}` with D x M == num_devices, or a one-line error."""
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
    if engine == "tf" and mesh["model"] > 1:
        raise UserError(f"mesh.model={mesh['model']} needs the jax engine (--config.engine=jax): "
                        "Keras 3's TensorFlow backend ignores layouts (keras-team/keras#18473)")
    return mesh


def input_pipelines(device_grid, local_devices) -> tuple[int, int]:
    """How many distinct input pipelines feed the mesh, and which one this process runs.

    `device_grid` is the (data, model) array of devices. A process feeds the
    batch rows of the data indices its devices hold. When every process holds
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
