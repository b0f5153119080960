"""A TPU slice's devices as a TPU VM sees them, read from the TPU runtime on any machine.

The TPU runtime (libtpu, JAX's `jax[tpu]`: the `tpu` extra) describes any
slice without a chip: `jax.experimental.topologies` returns its devices with
their ids, hosts (process indices), chip coordinates and slices, in the order
a TPU VM numbers them. JAX lays a mesh out on those coordinates, which puts
one host's chips in rows far apart (on a v5litepod-16 a 16-long data axis
visits hosts 0,0,1,1,1,1,0,2,3,3,3,3,2,2,2,0), so the toolkit's pod code is
checked against these descriptions rather than against CPU devices sorted by
host. A simulated pod (`python -m tpu_keras.launch --tpu=v5litepod-16`) uses
them too: each CPU device stands for the chip of its host and place.

Nothing leaves the machine. Off a TPU this module sets, before libtpu loads:
`TPU_SKIP_MDS_QUERY=1` (JAX and libtpu then ask no metadata server),
`ALLOW_MULTIPLE_LIBTPU_LOAD=1` (libtpu otherwise lets one process at a time
load it, and a simulated pod's hosts all do), and, for the load alone,
`TPU_ACCELERATOR_TYPE` and `TPU_WORKER_HOSTNAMES`, whose absence libtpu
0.0.42 reports in several alarming lines although nothing is wrong.
"""

# Imported inside functions: JAX (optional: absent on a plain install; the tf engine runs
# without JAX).
import contextlib
import functools
import importlib.util
import os

from tpu_keras.cluster import topology, tpu
from tpu_keras.errors import UserError, first_line

# Set by `python -m tpu_keras.launch --tpu=TYPE` for every simulated host.
SIMULATED_TPU_ENV = "TPU_KERAS_SIMULATED_TPU"
INSTALL = 'pip install -e ".[jax,tpu]"'


def installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


@functools.lru_cache(maxsize=None)
def devices(tpu_type: str) -> tuple:
    """The devices of `tpu_type` ('v5litepod-16'; '2xv4-16' for two slices), as libtpu
    describes them: `.id`, `.process_index` (the host), `.coords`, `.slice_index`.

    Raises a one-line `UserError` for a type the topology table or libtpu does
    not know, and where JAX or libtpu is not installed.
    """
    return slice_devices(*topology.parse_tpu(tpu_type))


@functools.lru_cache(maxsize=None)
def slice_devices(slices: int, found: topology.Slice) -> tuple:
    """The devices of `slices` slices like `found`, as libtpu describes them (`devices`)."""
    tpu_type = f"{slices}x{found.name}" if slices > 1 else found.name
    if importlib.util.find_spec("jax") is None or not installed():
        raise UserError(f"describing the TPU slice {tpu_type} needs JAX and libtpu, the TPU "
                        f"runtime (it runs without a TPU): {INSTALL}")
    from jax.experimental import topologies
    megacore = found.generation.tensorcores_per_chip == 2 and found.generation.devices_per_chip == 1
    options = {"chip_config_name": "megacore" if megacore else "default",
               "chips_per_host_bounds": found.host_shape}
    if slices > 1:
        options["num_slices"] = slices
    try:
        with _quiet_load(found):
            described = topologies.get_topology_desc(found.topology_name, "tpu", **options)
    except Exception as error:  # JaxRuntimeError and friends: libtpu's words, one line
        raise UserError(f"libtpu cannot describe {tpu_type} as {found.topology_name} "
                        f"({first_line(error)}); "
                        "check the TPU type, or install the libtpu of the JAX in use: "
                        f"{INSTALL}") from None
    return tuple(described.devices)


def simulated() -> str:
    """The TPU type the launcher simulates on this host's CPU devices, or ''."""
    return os.environ.get(SIMULATED_TPU_ENV, "")


@contextlib.contextmanager
def _quiet_load(found):
    """Loads libtpu as a machine without a TPU should: no metadata server, no lock
    against other processes, and none of the warnings about variables only a TPU VM sets
    (those two are set for the load and then restored)."""
    if tpu.attached():
        yield
        return
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    quieting = {"TPU_ACCELERATOR_TYPE": found.name, "TPU_WORKER_HOSTNAMES": "localhost"}
    added = [name for name in quieting if name not in os.environ]
    os.environ.update({name: quieting[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
