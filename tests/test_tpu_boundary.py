"""The TPU layer at its boundary: only the TPU runtime is faked.

The fakes stand in for the three calls that need a chip (the resolver's
lookup, connecting to a remote cluster, `initialize_tpu_system`) and are
shaped like the real ones: the resolver is a `ClusterResolver` that returns
`TPUSystemMetadata` with TPU device names, and initialisation returns a real
`tf.tpu.experimental.Topology`. `tf.distribute.TPUStrategy`, `connect()` and
everything above them are the real code.
"""

import dataclasses
import functools
import json
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from conftest import run_command
from tpu_keras import cluster as cluster_lib
from tpu_keras.cluster import topology, tpu
from tpu_keras.errors import UserError
from tpu_keras.measurement import peak


@dataclasses.dataclass
class _Device:
    name: str


class FakeCloudTpuClient:
    """The Cloud TPU API as the resolver sees it: this TPU's accelerator type."""

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def accelerator_type(self):
        return self._accelerator


def fake_resolver_cls(slice_name, calls):
    """A TPUClusterResolver stand-in for the slice `slice_name` ('v4-32'); records its arguments."""
    found = topology.parse_slice(slice_name)

    class FakeTPUClusterResolver(tf.distribute.cluster_resolver.ClusterResolver):
        def __init__(self, tpu=None, zone=None, project=None):
            calls.append(("resolver", dict(tpu=tpu, zone=zone, project=project)))
            self.task_type, self.task_id = "worker", 0
            self.tpu = tpu
            if tpu != "local":  # looked up by name: the Cloud TPU API knows its type
                self._cloud_tpu_client = FakeCloudTpuClient(found.name)

        def cluster_spec(self):
            return tf.train.ClusterSpec({"worker": [f"10.0.0.{i}:8470" for i in range(found.hosts)]})

        def master(self, task_type=None, task_id=None, rpc_layer=None):
            return "" if self.tpu == "local" else "grpc://10.0.0.0:8470"

        def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
            return {"TPU": found.devices_per_host}

        def get_tpu_system_metadata(self):
            tpus = [_Device(f"/job:worker/replica:0/task:{t}/device:TPU:{d}")
                    for t in range(found.hosts) for d in range(found.devices_per_host)]
            cpus = [_Device(f"/job:worker/replica:0/task:{t}/device:CPU:0") for t in range(found.hosts)]
            return tf.tpu.experimental.TPUSystemMetadata(
                num_cores=found.devices, num_hosts=found.hosts,
                num_of_cores_per_host=found.devices_per_host, topology=None, devices=tpus + cpus)

    return FakeTPUClusterResolver


SLICES = ("v4-8", "v4-32", "v5litepod-8", "v5litepod-16", "v6e-16")  # the slices faked here
CHIPS_BY_HOST = """
import json, sys
from tpu_keras.cluster import libtpu
def by_host(chips):
    hosts = sorted({chip.process_index for chip in chips})
    return [[list(c.coords) for c in sorted(chips, key=lambda c: c.id) if c.process_index == h]
            for h in hosts]
print(json.dumps({name: by_host(libtpu.devices(name)) for name in sys.argv[1:]}))
"""


@functools.lru_cache(maxsize=None)
def libtpu_chips():
    """{slice: [host][device] chip coordinates} of SLICES as libtpu describes them (one
    process for all; libtpu runs without a TPU)."""
    return json.loads(run_command([sys.executable, "-c", CHIPS_BY_HOST, *SLICES], timeout=120,
                                  merge_stderr=False).stdout)


def fake_topology(slice_name):
    """The real `Topology` of the slice: its chips' coordinates as libtpu gives them, one
    device per chip (every generation here has one core per device)."""
    coordinates = np.array([[chip[:3] + [0] for chip in host] for host in libtpu_chips()[slice_name]],
                           np.int32)
    mesh_shape = coordinates.reshape(-1, 4).max(axis=0) + 1
    return tf.tpu.experimental.Topology(mesh_shape=mesh_shape.tolist(), device_coordinates=coordinates)


def fake_runtime(slice_name, calls, metadata_type=""):
    def connect_to_cluster(resolver):
        calls.append(("connect_to_cluster", resolver.tpu))

    def initialize_tpu_system(resolver):
        calls.append(("initialize_tpu_system", resolver.tpu))
        return fake_topology(slice_name)

    return tpu.Runtime(resolver_cls=fake_resolver_cls(slice_name, calls),
                       connect_to_cluster=connect_to_cluster,
                       initialize_tpu_system=initialize_tpu_system,
                       metadata_accelerator_type=lambda: metadata_type)


@pytest.fixture
def no_tpu_env(monkeypatch):
    for name in ("TPU_NAME", tpu.ACCELERATOR_TYPE_ENV, "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_tf_engine_refuses_slices_before_it_looks_for_a_tpu(no_tpu_env):
    calls = []
    no_tpu_env.setattr(tpu, "RUNTIME", fake_runtime("v4-8", calls))
    with pytest.raises(UserError, match="mesh.slices=2 needs the jax engine"):
        cluster_lib.connect({"strategy": "tpu", "tpu": "my-v4"}, engine="tf", mesh={"slices": 2})
    no_tpu_env.setenv("TPU_KERAS_NUM_SLICES", "2")  # a pod the launcher simulated with --slices=2
    with pytest.raises(UserError, match="the launcher started 2 slices.*--config.mesh.slices=2"):
        cluster_lib.connect({"strategy": "tpu", "tpu": "my-v4"}, engine="tf")
    assert calls == []  # TPUStrategy never reaches the TPU


def test_a_named_single_host_tpu_is_looked_up_connected_and_initialised(no_tpu_env):
    calls = []
    no_tpu_env.setattr(tpu, "RUNTIME", fake_runtime("v4-8", calls))
    cluster = cluster_lib.connect({"strategy": "tpu", "tpu": "my-v4", "zone": "us-central2-b",
                                   "project": "proj"}, engine="tf")
    assert calls == [("resolver", dict(tpu="my-v4", zone="us-central2-b", project="proj")),
                     ("connect_to_cluster", "my-v4"), ("initialize_tpu_system", "my-v4")]
    assert isinstance(cluster.strategy, tf.distribute.TPUStrategy)
    # v4-8: 4 chips, each one (megacore) device; one VM.
    assert (cluster.kind, cluster.num_hosts, cluster.num_processes, cluster.num_replicas) == ("tpu", 1, 1, 4)
    assert cluster.strategy.extended.worker_devices == tuple(
        f"/job:worker/replica:0/task:0/device:TPU:{d}" for d in range(4))
    assert cluster.device_kind == "TPU v4-8"  # from the Cloud TPU API, through the resolver
    assert isinstance(cluster.topology, tf.tpu.experimental.Topology)
    assert cluster.topology.num_tasks == 1 and cluster.topology.num_tpus_per_task == 4
    # The MFU peak: 4 devices x 275 TFLOP/s bf16 (v4's published per-chip figure).
    assert peak.peak_flops(cluster, "bfloat16") == 4 * 275e12


def test_local_on_a_tpu_vm_drives_its_own_chips_without_connecting(no_tpu_env):
    calls = []
    no_tpu_env.setattr(tpu, "RUNTIME", fake_runtime("v5litepod-8", calls, metadata_type="v5litepod-8"))
    cluster = cluster_lib.connect({"strategy": "tpu", "tpu": "local"}, engine="tf")
    assert calls == [("resolver", dict(tpu="local", zone=None, project=None)),
                     ("initialize_tpu_system", "local")]  # no remote cluster to connect to
    assert (cluster.num_hosts, cluster.num_replicas, cluster.input_pipelines) == (1, 8, 1)
    assert cluster.device_kind == "TPU v5litepod-8"  # from the TPU VM's metadata server


def test_a_multi_host_pod_is_driven_by_one_client_that_feeds_every_host(no_tpu_env):
    calls = []
    no_tpu_env.setenv("TPU_NAME", "my-pod")  # what `scripts/tpu_vm.sh run --tf-pod` sets
    no_tpu_env.setattr(tpu, "RUNTIME", fake_runtime("v4-32", calls))
    cluster = cluster_lib.connect({"strategy": "auto"}, engine="tf")
    assert calls[0] == ("resolver", dict(tpu="my-pod", zone=None, project=None))
    assert ("connect_to_cluster", "my-pod") in calls
    # v4-32: 16 chips on 4 VMs. One process, four input pipelines (one per host's CPU).
    assert (cluster.kind, cluster.num_hosts, cluster.num_processes) == ("tpu", 4, 1)
    assert (cluster.num_replicas, cluster.replicas_per_host, cluster.input_pipelines) == (16, 4, 4)
    assert cluster.is_chief and cluster.mesh == {"slices": 1, "data": 16, "fsdp": 1, "expert": 1, "context": 1, "model": 1}
    hosts = {d.split("/device:")[0] for d in cluster.strategy.extended.worker_devices}
    assert hosts == {f"/job:worker/replica:0/task:{t}" for t in range(4)}
    assert cluster.topology.num_tasks == 4


def test_tpu_strategy_feeds_each_host_its_own_replicas_in_either_replica_order(no_tpu_env):
    """On the v5litepod-16 that libtpu describes: TPUStrategy numbers replicas host by host;
    a DeviceAssignment built from the topology walks the torus instead, interleaving hosts
    as the jax engine's mesh does. Either way each host's input pipeline feeds the replicas
    on its own chips."""
    no_tpu_env.setattr(tpu, "RUNTIME", fake_runtime("v5litepod-16", []))
    cluster = cluster_lib.connect({"strategy": "tpu", "tpu": "my-pod"}, engine="tf")
    host_of = lambda device: int(device.split("/task:")[1].split("/")[0])
    assert [host_of(d) for d in cluster.strategy.extended.worker_devices] == [r // 4 for r in range(16)]
    assignment = tf.tpu.experimental.DeviceAssignment.build(cluster.topology, num_replicas=16)
    resolver = fake_resolver_cls("v5litepod-16", [])(tpu="my-pod")
    ring = tf.distribute.TPUStrategy(resolver, experimental_device_assignment=assignment)
    hosts = [host_of(d) for d in ring.extended.worker_devices]
    assert hosts == [0, 0, 1, 1, 1, 1, 0, 2, 3, 3, 3, 3, 2, 2, 2, 0]  # the torus, host by chip
    for strategy in (cluster.strategy, ring):
        feeds = strategy.extended._device_input_worker_devices  # host CPU -> the TPUs it feeds
        assert len(feeds) == 4
        for host_device, devices in feeds.items():
            assert {host_of(d) for d in devices} == {host_of(host_device)} and len(devices) == 4


def test_the_accelerator_type_variable_names_the_slice(no_tpu_env):
    no_tpu_env.setenv(tpu.ACCELERATOR_TYPE_ENV, "v6e-16")
    no_tpu_env.setattr(tpu, "RUNTIME", fake_runtime("v6e-16", [], metadata_type="v4-8"))
    cluster = cluster_lib.connect({"strategy": "tpu", "tpu": "local"}, engine="tf")
    assert cluster.device_kind == "TPU v6e-16" and cluster.num_replicas == 16


def _forbidden(*args, **kwargs):
    raise AssertionError("the TPU runtime was called on a machine without a TPU")


def test_auto_never_picks_a_tpu_when_there_is_none(no_tpu_env):
    no_tpu_env.setattr(tpu, "RUNTIME", tpu.Runtime(_forbidden, _forbidden, _forbidden, _forbidden))
    assert not tpu.is_present("")
    cluster = cluster_lib.connect({"strategy": "auto"}, engine="tf")
    assert cluster.kind == "one_device"
    assert not isinstance(cluster.strategy, tf.distribute.TPUStrategy)


def test_tpu_detection_needs_a_name_or_device_files(no_tpu_env):
    assert not tpu.is_present("")
    assert tpu.is_present("my-tpu")
    no_tpu_env.setenv("TPU_NAME", "pod-1")
    assert tpu.is_present("")


class UnreachableResolver:
    """Stands in for TPUClusterResolver when the TPU's endpoint cannot be resolved."""

    def __init__(self, tpu, zone, project):
        raise ValueError(f"Could not lookup TPU {tpu} in zone {zone}")


def test_unreachable_tpu_is_one_line_that_says_what_to_check():
    with pytest.raises(UserError) as error:
        tpu.initialize("my-tpu", "us-central2-b", "proj",
                       runtime=tpu.Runtime(resolver_cls=UnreachableResolver))
    message = str(error.value)
    assert "\n" not in message
    assert "cluster.tpu='my-tpu'" in message and "Could not lookup TPU my-tpu" in message
    assert "--config.cluster.strategy=auto" in message


def test_a_tpu_that_fails_to_initialise_is_one_line(no_tpu_env):
    def initialize_fails(resolver):
        raise tf.errors.NotFoundError(None, None, "No TPU devices found.\nmore detail")

    runtime = dataclasses.replace(fake_runtime("v4-8", []), initialize_tpu_system=initialize_fails)
    with pytest.raises(UserError, match=r"^no TPU reachable as cluster.tpu='local' "
                                        r"\(No TPU devices found.\); check"):
        tpu.initialize("local", runtime=runtime)


class HangingResolver:
    """Stands in for TPUClusterResolver when the metadata server or TPU API never answers."""

    def __init__(self, tpu, zone, project):
        threading.Event().wait(60)


def test_a_tpu_lookup_that_hangs_ends_in_one_line():
    with pytest.raises(UserError, match=r"cluster.tpu='my-tpu' \(looking it up got no answer "
                                         r"within 0.2 s\)"):
        tpu.initialize("my-tpu", runtime=tpu.Runtime(resolver_cls=HangingResolver),
                       lookup_timeout_s=0.2)
