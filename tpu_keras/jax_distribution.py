"""The jax engine's side of `connect`: processes, the device mesh, and checked layouts.

Keras on JAX distributes through one global `keras.distribution`
(DESIGN.md, "Two engines"). `connect` starts the processes of a multi-host
run, lays every device out on the `(data, model)` mesh and sets a
distribution that splits the batch over `data`. `set_layout` then swaps in
one built from a model's layout rules: `DataParallel` when the model axis is
1, otherwise `ModelParallel` with the rules as its `LayoutMap`. Both check
each weight against the rules as Keras creates it, before any memory is
allocated for it, so a bad rule fails with one line instead of a JAX shape
error or a silently replicated weight.
"""

import os

from absl import logging
import jax
import keras

from tpu_keras import mesh as mesh_lib
from tpu_keras import tpu
from tpu_keras.cluster import Cluster
from tpu_keras.engine import VIRTUAL_DEVICES_ENV
from tpu_keras.errors import UserError
from tpu_keras.layout import Placer
from tpu_keras.layout.rules import dtype_name

# Set by `python -m tpu_keras.launch` for every simulated host of a jax run.
COORDINATOR_ENV = "TPU_KERAS_COORDINATOR"
NUM_HOSTS_ENV, HOST_INDEX_ENV = "TPU_KERAS_NUM_HOSTS", "TPU_KERAS_HOST_INDEX"


def connect(config, mesh_config) -> Cluster:
    _initialize_processes(config)
    wanted = config.get("virtual_devices", 0) or int(os.environ.get(VIRTUAL_DEVICES_ENV, 0) or 0)
    if wanted > 1 and jax.local_device_count() != wanted and jax.default_backend() == "cpu":
        raise UserError(f"cluster.virtual_devices={wanted} on the jax engine must be set before JAX "
                        f"starts: call tpu_keras.engine.select('jax', {wanted}) before importing "
                        f"keras, or set XLA_FLAGS=--xla_force_host_platform_device_count={wanted}")
    devices = keras.distribution.list_devices()
    mesh = mesh_lib.resolve(mesh_config, len(devices), "jax")
    device_mesh = keras.distribution.DeviceMesh((mesh["data"], mesh["model"]), mesh_lib.AXES, devices)
    local = [f"{d.platform}:{d.id}" for d in jax.local_devices()]
    pipelines, index = mesh_lib.input_pipelines(device_mesh.devices.tolist(), local)
    cluster = Cluster(strategy=None, kind="jax", num_hosts=jax.process_count(),
                      host_index=jax.process_index(), num_replicas=mesh["data"],
                      device_kind=f"{len(devices)} x {jax.devices()[0].device_kind}",
                      engine="jax", mesh=mesh, device_mesh=device_mesh,
                      input_pipelines=pipelines, input_index=index)
    set_layout(cluster, Placer((), mesh))
    return cluster


def set_layout(cluster: Cluster, placer: Placer) -> None:
    """Sets the global Keras distribution for a model with the placer's layout rules."""
    if cluster.mesh["model"] == 1:
        data_mesh = keras.distribution.DeviceMesh(
            (cluster.mesh["data"],), ["data"], cluster.device_mesh.devices.reshape(-1).tolist())
        distribution = _CheckedDataParallel(placer, device_mesh=data_mesh, auto_shard_dataset=False)
    else:
        layout_map = keras.distribution.LayoutMap(cluster.device_mesh)
        for rule in placer.rules:
            layout_map[rule.pattern] = tuple(rule.axes)
        distribution = _CheckedModelParallel(placer, layout_map=layout_map, batch_dim_name="data",
                                             auto_shard_dataset=False)
    # auto_shard_dataset=False: tpu_keras.data already gives each process its own rows.
    keras.distribution.set_distribution(distribution)


class _Checked:
    """Checks each new variable against the rules before Keras lays it out."""

    def __init__(self, placer: Placer, **kwargs):
        super().__init__(**kwargs)
        self.placer = placer

    def get_variable_layout(self, variable):
        self.placer.place(variable.path, variable.shape, dtype_name(variable.dtype))
        return super().get_variable_layout(variable)


class _CheckedDataParallel(_Checked, keras.distribution.DataParallel):
    pass


class _CheckedModelParallel(_Checked, keras.distribution.ModelParallel):
    pass


def _initialize_processes(config) -> None:
    """Joins a multi-process run: the local launcher's coordinator, or a TPU pod's."""
    coordinator = os.environ.get(COORDINATOR_ENV)
    if coordinator:
        num_hosts, index = int(os.environ[NUM_HOSTS_ENV]), int(os.environ[HOST_INDEX_ENV])
        logging.info("jax: joining %s as process %d of %d", coordinator, index, num_hosts)
        keras.distribution.initialize(coordinator, num_hosts, index)
    elif tpu.is_present(config.get("tpu", "")):
        keras.distribution.initialize()  # JAX finds the pod's coordinator itself
