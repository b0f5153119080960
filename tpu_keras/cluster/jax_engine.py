"""The jax engine's side of `connect`: the run's processes and the device mesh.

`connect` joins the processes of a multi-host run (the local launcher's
coordinator, or a TPU pod's), lays every device out on the `(data, fsdp, expert,
model)` mesh (slices, if more than one, on the outer part of `data`:
`parallelism.mesh.device_grid`), and makes Keras split the batch over `data`
(a data-parallel `keras.distribution`, so user code that only connects
trains data parallel).
A run then replaces that with the distribution its model's layout rules
give (`parallelism.distribution`).

`cluster.strategy='one_device'` takes this process's first device alone,
joining no other process: a command that restores a run on one host
(`export`, `generate`) works on a host of any number of devices. Given
`refit_mesh` (a global batch size), a mesh of fixed sizes that these devices
do not fit is fitted to them and to that batch (`parallelism.mesh.refit`): an
evaluation job on another host.
"""

import math
import os

from absl import logging
import jax
import keras

from tpu_keras.cluster import libtpu, tpu
from tpu_keras.cluster.engine import NUM_SLICES_ENV, SLICE_ENV, VIRTUAL_DEVICES_ENV
from tpu_keras.cluster.record import Cluster
from tpu_keras.errors import UserError
from tpu_keras.parallelism import Placer, distribution
from tpu_keras.parallelism import mesh as mesh_lib

# Set by `python -m tpu_keras.launch` for every simulated host of a jax run.
COORDINATOR_ENV = "TPU_KERAS_COORDINATOR"
NUM_HOSTS_ENV, HOST_INDEX_ENV = "TPU_KERAS_NUM_HOSTS", "TPU_KERAS_HOST_INDEX"


def connect(config, mesh_config, refit_mesh: int = 0) -> Cluster:
    """The jax cluster: this process's place among the run's, and every device on the mesh."""
    one_device = config.get("strategy", "auto") == "one_device"
    if not one_device:
        _initialize_processes(config)
    wanted = config.get("virtual_devices", 0) or int(os.environ.get(VIRTUAL_DEVICES_ENV, 0) or 0)
    if wanted > 1 and jax.local_device_count() != wanted and jax.default_backend() == "cpu":
        raise UserError(f"cluster.virtual_devices={wanted} on the jax engine must be set before JAX "
                        f"starts: call tpu_keras.cluster.engine.select('jax', {wanted}) before importing "
                        f"keras, or set XLA_FLAGS=--xla_force_host_platform_device_count={wanted}")
    devices = jax.local_devices()[:1] if one_device else jax.devices()
    try:
        mesh = mesh_lib.resolve(mesh_config, len(devices), "jax")
    except UserError:
        if not refit_mesh:
            raise
        mesh = mesh_lib.refit(mesh_config, len(devices), refit_mesh)
        logging.warning("the mesh %s does not fit these %d devices: using %s", dict(mesh_config),
                        len(devices), mesh_lib.describe(mesh))
        devices = devices[:math.prod(mesh.values())]
    simulated = libtpu.simulated()  # `launch --tpu`: lay the mesh out as on that slice
    chips = libtpu.devices(simulated) if simulated and devices[0].platform != "tpu" else None
    grid = mesh_lib.grid_of(devices, mesh, chips=chips)
    _check_launcher_slices(mesh, grid)
    device_mesh = keras.distribution.DeviceMesh(
        grid.shape, mesh_lib.AXES, [_name(d) for d in grid.flat])
    batch_splits = mesh_lib.batch_splits(mesh)
    rows = mesh_lib.batch_rows(grid, mesh_lib.row_devices(mesh))
    pipelines, index = mesh_lib.input_pipelines(rows, jax.process_index())
    if simulated:
        logging.info("jax: %s laid out as on a %s; this host feeds batch rows %s",
                     mesh_lib.describe(mesh), simulated, list(rows[jax.process_index()]))
    cluster = Cluster(strategy=None, kind="jax", num_hosts=jax.process_count(),
                      host_index=jax.process_index(), num_replicas=batch_splits,
                      device_kind=f"{len(devices)} x {jax.devices()[0].device_kind}",
                      engine="jax", mesh=mesh, device_mesh=device_mesh,
                      input_pipelines=pipelines, input_index=index)
    distribution.set_layout(cluster, Placer((), mesh))
    return cluster


def _name(device) -> str:
    """A device as `keras.distribution` names it: 'cpu:3'."""
    return f"{device.platform}:{device.id}"


def _check_launcher_slices(mesh, grid) -> None:
    """On a pod the launcher simulates, `mesh.slices` must be its slice count, and this
    process's devices must sit in the rows of the slice it was told it is in."""
    launched = int(os.environ.get(NUM_SLICES_ENV, 0) or 0)
    if not launched:
        return
    if launched != mesh[mesh_lib.SLICES]:
        raise UserError(f"mesh.slices={mesh[mesh_lib.SLICES]} but the launcher started {launched} "
                        f"slice(s); set --config.mesh.slices={launched}")
    told = int(os.environ[SLICE_ENV])
    local = set(jax.local_devices())
    rows = {mesh_lib.slice_of_row(r, mesh) for r, row in enumerate(grid) if local & set(row.flat)}
    if rows != {told}:
        raise UserError(f"this host is in slice {told} ({SLICE_ENV}) but its devices are in mesh "
                        f"rows of slice(s) {sorted(rows)}; give every host the same "
                        "--devices_per_host")


def _initialize_processes(config) -> None:
    """Joins a multi-process run: the local launcher's coordinator, or a TPU pod's."""
    coordinator = os.environ.get(COORDINATOR_ENV)
    if coordinator:
        num_hosts, index = int(os.environ[NUM_HOSTS_ENV]), int(os.environ[HOST_INDEX_ENV])
        logging.info("jax: joining %s as process %d of %d", coordinator, index, num_hosts)
        keras.distribution.initialize(coordinator, num_hosts, index)
    elif tpu.is_present(config.get("tpu", "")):
        keras.distribution.initialize()  # JAX finds the pod's coordinator itself
