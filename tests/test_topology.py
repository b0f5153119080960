"""The TPU topology table: slice names give the documented hosts, chips and devices;
the MFU peak on TPU comes from it."""

import ast
import types
from pathlib import Path

import pytest

from tpu_keras.cluster import topology
from tpu_keras.measurement import peak
from tpu_keras.errors import UserError

GiB = 2 ** 30

# name: (hosts = TPU VMs, chips, devices, devices per host), from the Cloud TPU pages
# (the number after the dash counts TensorCores on v2/v3/v4/v5p, chips on v5e/v6e).
DOCUMENTED = {
    "v2-8": (1, 4, 8, 8),            # 4 chips x 2 TensorCores, each its own device
    "v3-32": (4, 16, 32, 8),
    "v4-8": (1, 4, 4, 4),            # megacore: 2 TensorCores are one device
    "v4-32": (4, 16, 16, 4),
    "v5litepod-1": (1, 1, 1, 1),
    "v5litepod-4": (1, 4, 4, 4),     # single host, fewer chips
    "v5litepod-8": (1, 8, 8, 8),     # one 8-chip VM
    "v5litepod-16": (4, 16, 16, 4),  # multi-host v5e: 4-chip VMs
    "v5p-8": (1, 4, 4, 4),
    "v5p-128": (16, 64, 64, 4),
    "v6e-8": (1, 8, 8, 8),
    "v6e-16": (4, 16, 16, 4),        # v6e page: 16 chips, 2 hosts, 4 VMs
    "v6e-256": (64, 256, 256, 4),    # v6e page: 256 chips, 32 hosts, 64 VMs
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_slice_names_give_the_documented_hosts_chips_and_devices(name):
    s = topology.parse_slice(name)
    assert (s.hosts, s.chips, s.devices, s.devices_per_host) == DOCUMENTED[name]
    assert s.chips_per_host * s.hosts == s.chips
    assert s.name == name


def test_tensorcores_and_aliases():
    assert topology.parse_slice("v4-32").tensorcores == 32
    assert topology.parse_slice("v3-32").tensorcores == 32
    alias = topology.parse_slice(" V5E-16 ")
    assert alias.name == "v5litepod-16" and alias.generation.name == "v5e"
    assert topology.parse_slice("v5p-12288").chips == 6144  # the largest v5p slice
    assert topology.parse_slice("v4-4096").chips == 2048    # the largest v4 slice, 8x16x16


# HBM per device: what the devices report (XLA's rounded GiB where no exact bytes were found),
# not the published capacity (16 GiB per v3 TensorCore, 32 GiB per v4/v6e chip, 16 GB per v5e).
REPORTED_HBM = {
    "v2-8": round(7.48 * GiB),
    "v3-8": round(15.48 * GiB),
    "v4-32": 33_014_415_360,         # 30.75 GiB
    "v5litepod-8": round(15.75 * GiB),
    "v5p-8": 102_803_439_616,        # 95.74 GiB
    "v6e-8": 33_550_237_696,         # 31.25 GiB
}


@pytest.mark.parametrize("name", sorted(REPORTED_HBM))
def test_hbm_is_what_the_devices_report(name):
    assert topology.parse_slice(name).hbm_bytes_per_device == REPORTED_HBM[name]


def test_every_generation_carries_its_sources():
    """Each Generation(...) of the table follows a comment that cites its public pages."""
    source = Path(topology.__file__).read_text()
    table = source[source.index("GENERATIONS = {"):source.index("_BY_PREFIX")]
    blocks = table.split("    Generation(")[:-1]
    assert len(blocks) == len(topology.GENERATIONS)
    for block in blocks:
        comment = [line for line in block.splitlines() if line.strip().startswith("#")]
        assert any("https://cloud.google.com/tpu/docs/" in line for line in comment), block
        assert "HBM" in " ".join(comment), block


def test_per_device_memory_and_peak():
    v3 = topology.parse_slice("v3-8")
    assert v3.hbm_bytes_per_device == v3.generation.hbm_bytes_per_chip // 2  # 2 devices a chip
    assert v3.peak_flops_per_device == 61.5e12            # 123 TFLOP/s per chip, 2 devices
    v4 = topology.parse_slice("v4-32")
    assert v4.hbm_bytes_per_device == v4.generation.hbm_bytes_per_chip      # megacore: 1 device
    assert v4.peak_flops == 16 * 275e12
    assert topology.parse_slice("v6e-256").peak_flops == pytest.approx(234.9e15, rel=1e-3)


def test_every_generation_is_consistent():
    for gen in topology.GENERATIONS.values():
        assert gen.tensorcores_per_chip % gen.devices_per_chip == 0
        assert gen.max_slice_chips <= gen.pod_chips
        largest = gen.max_slice_chips * gen.name_units_per_chip
        assert topology.parse_slice(f"{gen.prefix}-{largest}").chips == gen.max_slice_chips


@pytest.mark.parametrize("name, fragments", [
    ("v4-7", ["counts TensorCores", "v4-8, v4-16, v4-24, v4-32", "v4-4096"]),
    # 36 chips make no AxBxC of 2x2 host blocks with every side <= 4 or a multiple of 4
    ("v4-72", ["v4-64, v4-96", "each side a multiple of 4"]),
    ("v4-8192", ["the largest v4 slice is v4-4096 (2048 chips)"]),  # the pod is not one slice
    ("v4-16384", ["the largest v4 slice is v4-4096"]),
    ("v5p-12296", ["the largest v5p slice is v5p-12288"]),
    ("v5litepod-12", ["counts chips", "v5litepod-16"]),
    ("v2-16", ["v2-8, v2-32"]),
    ("v9-8", ["v2, v3, v4, v5litepod (v5e), v5p, v6e"]),
    ("v5lightpod-16", ["did you mean 'v5litepod-16'?"]),
    ("v4", ["<generation>-<size>"]),
])
def test_bad_slice_names_say_what_to_write(name, fragments):
    with pytest.raises(UserError) as error:
        topology.parse_slice(name)
    message = str(error.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_unknown_version_gets_no_misleading_suggestion():
    with pytest.raises(UserError) as error:
        topology.parse_slice("v9-8")
    assert "did you mean" not in str(error.value)


@pytest.mark.parametrize("kind, generation", [
    ("TPU v2", "v2"), ("TPU v3", "v3"), ("TPU v4", "v4"),
    ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v5", "v5p"), ("TPU v5p", "v5p"),
    ("TPU v6 lite", "v6e"), ("TPU v6e", "v6e"),
    ("8 x TPU v4", "v4"),          # Cluster.device_kind on the jax engine
    ("TPU v5litepod-16", "v5e"),   # an accelerator type
    ("TPU v4 lite", None), ("TPU", None), ("8 x CPU", None), ("1 x NVIDIA H100 80GB HBM3", None),
])
def test_device_kinds_map_to_generations(kind, generation):
    found = topology.generation_of_device_kind(kind)
    assert (found.name if found else None) == generation


def test_topology_imports_no_tensorflow():
    """The table must stay cheap to import (info, plan and launch read it before TensorFlow)."""
    tree = ast.parse(Path(topology.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"dataclasses", "functools", "math", "re", "typing", "tpu_keras.errors"}, imported


def _cluster(kind, device_kind, replicas, model=1, hosts=1):
    return types.SimpleNamespace(kind=kind, device_kind=device_kind, num_replicas=replicas,
                                 mesh={"data": replicas, "model": model}, num_hosts=hosts,
                                 engine="jax" if kind == "jax" else "tf")


def _no_measuring(*args, **kwargs):
    raise AssertionError("a TPU peak comes from the table, not a measured matmul")


def test_tpu_peak_is_the_published_figure_for_every_device(monkeypatch):
    monkeypatch.delenv(peak.PEAK_ENV, raising=False)
    monkeypatch.setattr(peak, "matmul_ceiling", _no_measuring)
    # TPUStrategy on a v4-32: 16 devices (one per megacore chip), 4 hosts.
    assert peak.peak_flops(_cluster("tpu", "TPU v4", 16, hosts=4), "bfloat16") == 16 * 275e12
    # v3-8: 8 devices, each half a chip.
    assert peak.peak_flops(_cluster("tpu", "TPU v3", 8), "float32") == 8 * 61.5e12
    # jax engine on a v5e-16 with a 8 x 2 mesh: the peak covers all 16 devices.
    jax_cluster = _cluster("jax", "16 x TPU v5 lite", 8, model=2, hosts=4)
    assert peak.peak_flops(jax_cluster, "bfloat16") == 16 * 197e12


def test_tpu_peak_unknown_generation_is_zero_and_env_still_overrides(monkeypatch):
    monkeypatch.delenv(peak.PEAK_ENV, raising=False)
    monkeypatch.setattr(peak, "matmul_ceiling", _no_measuring)
    assert peak.peak_flops(_cluster("tpu", "TPU", 8), "bfloat16") == 0.0
    monkeypatch.setenv(peak.PEAK_ENV, "1.5e15")
    assert peak.peak_flops(_cluster("tpu", "TPU v4", 16), "bfloat16") == 1.5e15


@pytest.mark.parametrize("name, shape, wraps", [
    # Google's own table of TPU types (xpk's system_characteristics, as MaxText copies it).
    ("v4-8", "v4:2x2x1", False), ("v4-32", "v4:2x2x4", False), ("v4-128", "v4:4x4x4", True),
    ("v4-384", "v4:4x4x12", True), ("v4-4096", "v4:8x16x16", True),
    ("v5p-1280", "v5:4x8x20", True), ("v5p-3456", "v5:12x12x12", True),
    ("v5p-12288", "v5:16x16x24", True),
    ("v5litepod-8", "v5e:2x4", False), ("v5litepod-16", "v5e:4x4", False),
    ("v5litepod-128", "v5e:8x16", (False, True)), ("v6e-256", "v6e:16x16", True),
])
def test_slices_have_the_chip_shapes_google_publishes(name, shape, wraps):
    found = topology.parse_slice(name)
    assert found.topology_name == shape
    assert found.wraparound == (wraps if isinstance(wraps, tuple) else (wraps,) * len(found.chip_shape))
    assert found.host_shape == ((2, 4, 1) if name == "v5litepod-8" else (2, 2, 1))
