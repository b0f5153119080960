"""What `connect()` finds on this machine, as `python -m tpu_keras.info` prints it.

The strategy (or jax mesh) a run would get, hosts and this host's index,
replicas, devices, the TPU slice and its published figures, and the peak
FLOP/s that MFU divides by.
"""

import os
import re

from tpu_keras.cluster import topology, tpu
from tpu_keras.errors import UserError
from tpu_keras.measurement import peak
from tpu_keras.parallelism import mesh as mesh_lib
from tpu_keras.training import auto_values


def facts(cluster, policy: str = "float32") -> dict:
    """What a run on `cluster` in the dtype policy `policy` would see, JSON-ready."""
    dtype = auto_values.compute_dtype(policy)
    slice_type = _slice_type(cluster)
    return {
        "engine": cluster.engine,
        "strategy": cluster.kind,
        "hosts": cluster.num_hosts,
        "processes": cluster.num_processes,
        "host_index": cluster.host_index,
        "replicas": cluster.num_replicas,
        "replicas_per_host": cluster.replicas_per_host,
        "mesh": dict(cluster.mesh),
        "devices": cluster.num_replicas * cluster.mesh["model"],
        "device_kind": cluster.device_kind,
        "input_pipelines": cluster.input_pipelines,
        "tpu": _slice_facts(slice_type) if slice_type else None,
        "precision": policy,
        "peak_flops": peak.peak_flops(cluster, dtype),
        "peak_flops_source": _peak_source(cluster),
    }


def _slice_type(cluster) -> str:
    """'v4-32', or '' off a TPU. TPUStrategy's device kind already names the slice
    (`connect` asked for it); a jax device kind names only the chip, so ask again."""
    named = re.search(r"\bv\w+-\d+$", cluster.device_kind)
    if named:
        return named.group(0)
    on_tpu = cluster.kind == "tpu" or topology.generation_of_device_kind(cluster.device_kind)
    return tpu.accelerator_type() if on_tpu else ""


def _slice_facts(slice_type: str) -> dict:
    try:
        found = topology.parse_slice(slice_type)
    except UserError as error:
        return {"slice": slice_type, "error": str(error)}
    gen = found.generation
    return {"slice": found.name, "generation": gen.name, "hosts": found.hosts,
            "chips": found.chips, "devices": found.devices,
            "devices_per_host": found.devices_per_host,
            "tensorcores_per_chip": gen.tensorcores_per_chip,
            "hbm_bytes_per_device": found.hbm_bytes_per_device,
            "peak_bf16_flops_per_device": found.peak_flops_per_device}


def _peak_source(cluster) -> str:
    if os.environ.get(peak.PEAK_ENV):
        return peak.PEAK_ENV
    if topology.generation_of_device_kind(cluster.device_kind) is not None:
        return "published bf16 peak per device (tpu_keras.cluster.topology) x devices"
    if cluster.kind == "tpu":
        return "unknown TPU type: set TPU_ACCELERATOR_TYPE (e.g. v4-32) or TPU_KERAS_PEAK_FLOPS"
    return f"measured matmul ceiling, cached in {os.path.dirname(peak.cache_file())}"


def format_table(info: dict) -> str:
    rows = [("engine", info["engine"]), ("strategy", info["strategy"]),
            ("hosts", f"{info['hosts']} ({info['processes']} process(es); this is host "
                      f"{info['host_index']})"),
            ("replicas", f"{info['replicas']} ({info['replicas_per_host']} per host)"),
            ("mesh", mesh_lib.describe(info["mesh"])),
            ("devices", info["device_kind"] if info["device_kind"][:1].isdigit()
                        else f"{info['devices']} x {info['device_kind']}"),
            ("input pipelines", str(info["input_pipelines"]))]
    slice_facts = info["tpu"]
    if slice_facts and "error" in slice_facts:
        rows.append(("TPU slice", f"{slice_facts['slice']} ({slice_facts['error']})"))
    elif slice_facts:
        rows.append(("TPU slice", (
            f"{slice_facts['slice']} ({slice_facts['generation']}): {slice_facts['hosts']} host(s), "
            f"{slice_facts['chips']} chips, {slice_facts['devices']} devices "
            f"({slice_facts['devices_per_host']} per host), "
            f"{slice_facts['hbm_bytes_per_device'] / 2 ** 30:.2f} GiB HBM per device")))
    else:
        rows.append(("TPU slice", "none"))
    rows += [("precision", info["precision"]),
             ("MFU peak", f"{info['peak_flops'] / 1e12:.3g} TFLOP/s ({info['peak_flops_source']})")]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
