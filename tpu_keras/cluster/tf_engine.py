"""The tf engine's side of `connect`: the tf.distribute strategy that fits the hardware.

TPU (through `tpu`), multi-worker from TF_CONFIG, mirrored over several
local devices, or one device. Without a GPU or TPU the CPU can be split into
logical devices (`split_cpu`), and several processes on one machine can
form a multi-worker cluster of CPU-only hosts with several replicas each
(`LocalDevicesMultiWorkerStrategy`): a pod simulated on a laptop.

One slice at most: `TPUStrategy` is one TensorFlow client driving the hosts
of the one TPU its resolver names, and nothing in tf.distribute knows of
slices or of the data-center network between them (Cloud TPU Multislice is
JAX's and PyTorch's, multi-controller). So `mesh.slices > 1`, or a pod the
launcher simulated with `--slices`, is a one-line error that points at the
jax engine.
"""

import dataclasses
import json
import os

import tensorflow as tf
# No public API makes a CPU-only worker hold several replicas (docs/design.md).
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.distribute import distribute_lib

from tpu_keras.cluster import tpu
from tpu_keras.cluster.engine import NUM_SLICES_ENV, VIRTUAL_DEVICES_ENV
from tpu_keras.cluster.record import Cluster
from tpu_keras.errors import UserError
from tpu_keras.parallelism import mesh as mesh_lib


def connect(config, mesh=None) -> Cluster:
    """The strategy `config.cluster.strategy` asks for ('auto': the first that fits)."""
    strategy = config.get("strategy", "auto")
    _refuse_slices()
    mesh_lib.check(mesh, "tf")  # what no strategy can run, before reaching for the hardware
    split_cpu(config.get("virtual_devices", 0) or int(os.environ.get(VIRTUAL_DEVICES_ENV, 0)))
    if strategy == "tpu" or (strategy == "auto" and tpu.is_present(config.get("tpu", ""))):
        cluster = _connect_tpu(config)
    elif strategy == "multi_worker" or (strategy == "auto" and _tf_config_workers() > 1):
        cluster = _connect_multi_worker()
    elif strategy == "mirrored" or (strategy == "auto" and len(_local_devices()) > 1):
        cluster = _connect_mirrored()
    else:
        cluster = _connect_one_device()
    return dataclasses.replace(cluster, mesh=mesh_lib.resolve(mesh, cluster.num_replicas, "tf"))


def _refuse_slices() -> None:
    slices = int(os.environ.get(NUM_SLICES_ENV, 0) or 0)
    if slices > 1:
        raise UserError(f"the launcher started {slices} slices, which the tf engine cannot span "
                        "(TPUStrategy drives one slice); run with --config.engine=jax "
                        f"--config.mesh.slices={slices}")


def split_cpu(num_devices: int) -> None:
    """Splits the host CPU into `num_devices` logical devices (a simulated pod slice).

    TensorFlow fixes its devices when it runs its first op, so this must come
    before anything else touches TensorFlow. The replicas run at once and
    share one pool of op threads: with the pool left at a thread per core,
    each replica's XLA step fans out over every core and they thrash. A
    replica gets its share of the cores instead (measured: docs/performance.md),
    unless the user set the pool's size.
    """
    if num_devices <= 1:
        return
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu) or []
    if len(current) == num_devices:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
    except RuntimeError:
        raise UserError(
            f"cannot split the CPU into {num_devices} devices: TensorFlow is already "
            "initialized; call tpu_keras.connect() before running any TensorFlow op"
        ) from None
    if not tf.config.threading.get_intra_op_parallelism_threads():
        tf.config.threading.set_intra_op_parallelism_threads(
            max(1, len(os.sched_getaffinity(0)) // num_devices))


def _cpu_split_count() -> int:
    cpu = tf.config.list_physical_devices("CPU")[0]
    return len(tf.config.get_logical_device_configuration(cpu) or [None])


def _local_devices():
    """The accelerators of this host, or its logical CPU devices when it has none.

    Names are host-local (`/device:CPU:1`) on purpose: once collective ops are
    enabled, TensorFlow lists the other workers' devices too.
    """
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return gpus
    return [tf.config.LogicalDevice(f"/device:CPU:{i}", "CPU") for i in range(_cpu_split_count())]


def _device_kind(devices) -> str:
    kind = devices[0].device_type
    if kind == "GPU":
        gpu = tf.config.list_physical_devices("GPU")[0]
        kind = tf.config.experimental.get_device_details(gpu).get("device_name", "GPU")
    return f"{len(devices)} x {kind}"


def _tf_config_workers() -> int:
    cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
    return len(cluster.get("worker", [])) + len(cluster.get("chief", []))


def _connect_tpu(config) -> Cluster:
    """One client drives the whole slice: this process is host 0 and feeds every host."""
    resolver, topology = tpu.initialize(config.get("tpu", ""), config.get("zone", ""),
                                        config.get("project", ""))
    strategy = tf.distribute.TPUStrategy(resolver)
    return Cluster(strategy, "tpu", num_hosts=strategy.extended.num_hosts, host_index=0,
                   num_replicas=strategy.num_replicas_in_sync,
                   device_kind=tpu.device_kind(resolver), topology=topology)


def _connect_multi_worker() -> Cluster:
    if _tf_config_workers() < 1:
        raise UserError("cluster.strategy='multi_worker' needs TF_CONFIG to list the "
                        "workers; start the hosts with `python -m tpu_keras.launch`")
    strategy = LocalDevicesMultiWorkerStrategy()
    resolver = strategy.cluster_resolver
    return Cluster(strategy, "multi_worker", num_hosts=_tf_config_workers(),
                   host_index=resolver.task_id or 0,
                   num_replicas=strategy.num_replicas_in_sync,
                   device_kind=_device_kind(_local_devices()))


def _connect_mirrored() -> Cluster:
    devices = _local_devices()
    strategy = tf.distribute.MirroredStrategy([d.name for d in devices])
    return Cluster(strategy, "mirrored", num_hosts=1, host_index=0,
                   num_replicas=len(devices), device_kind=_device_kind(devices))


def _connect_one_device() -> Cluster:
    devices = _local_devices()[:1]
    strategy = tf.distribute.OneDeviceStrategy(devices[0].name)
    return Cluster(strategy, "one_device", num_hosts=1, host_index=0, num_replicas=1,
                   device_kind=_device_kind(devices))


class _LocalDevicesExtended(collective_all_reduce_strategy.CollectiveAllReduceExtended):
    """Uses every logical CPU device of a host as a replica when it has no accelerator.

    Upstream MultiWorkerMirroredStrategy gives a CPU-only worker exactly one
    replica, which makes a simulated pod (several hosts x several devices)
    impossible. On GPU and TPU hosts it behaves exactly like upstream.
    """

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        devices, device_type = super()._initialize_local_devices(cluster_resolver, worker_device)
        if device_type == "CPU":
            count = _cpu_split_count()
            devices = tuple(f"{worker_device}/device:CPU:{i}" for i in range(count))
        return devices, device_type


class LocalDevicesMultiWorkerStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """MultiWorkerMirroredStrategy whose CPU-only workers may hold several replicas."""

    def __init__(self, cluster_resolver=None):
        # Skips the parent's __init__ only to swap in the extended class above.
        options = tf.distribute.experimental.CommunicationOptions()
        distribute_lib.Strategy.__init__(  # pylint: disable=non-parent-init-called
            self, _LocalDevicesExtended(self, cluster_resolver=cluster_resolver,
                                        communication_options=options))
