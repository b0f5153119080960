"""The TPU-only layer: find a TPU, connect to it, initialise it.

Kept thin on purpose: nothing here can run without a TPU, so everything else
in the toolkit talks to the `TPUStrategy` built from what this returns, and
tests exercise this boundary with a fake resolver.
"""

# Imported inside functions: TensorFlow (the engine must be selected first: engine.select).
import dataclasses
import os
import threading
import urllib.request
from typing import Any, Callable

from tpu_keras.errors import UserError, first_line

# On a TPU VM the chips are local character devices; v4 and older expose
# /dev/accel*, v5e and newer /dev/vfio/*.
_TPU_VM_DEVICE_FILES = ("/dev/accel0", "/dev/vfio/0")
# Looking a TPU up by name asks the GCE metadata server and the Cloud TPU API,
# with no timeout of their own: off Google Cloud that can hang for minutes.
LOOKUP_TIMEOUT_S = 60
# What a TPU VM's metadata server says the slice is ('v4-32'); the variable overrides it.
ACCELERATOR_TYPE_ENV = "TPU_ACCELERATOR_TYPE"
_METADATA_URL = ("http://{host}/computeMetadata/v1/instance/attributes/accelerator-type")


def _metadata_accelerator_type(timeout_s: float = 2.0) -> str:
    """The slice type from the TPU VM's metadata server, or '' off a TPU VM."""
    host = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
    request = urllib.request.Request(_METADATA_URL.format(host=host),
                                     headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read().decode().strip()
    except (OSError, ValueError):
        return ""


# TensorFlow's TPU calls, imported when called: the jax engine only asks `is_present`,
# and a GPU machine's JAX image may have no TensorFlow.
def _resolver(*args, **kwargs):
    import tensorflow as tf
    return tf.distribute.cluster_resolver.TPUClusterResolver(*args, **kwargs)


def _connect_to_cluster(resolver):
    import tensorflow as tf
    return tf.config.experimental_connect_to_cluster(resolver)


def _initialize_tpu_system(resolver):
    import tensorflow as tf
    return tf.tpu.experimental.initialize_tpu_system(resolver)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The calls that need a real TPU, gathered so tests can swap in fakes shaped like them.

    Everything else - `tf.distribute.TPUStrategy` included - is the real thing.
    """

    resolver_cls: Callable[..., Any] = _resolver
    connect_to_cluster: Callable[[Any], Any] = _connect_to_cluster
    initialize_tpu_system: Callable[[Any], Any] = _initialize_tpu_system
    metadata_accelerator_type: Callable[[], str] = _metadata_accelerator_type


RUNTIME = Runtime()


def is_present(name: str = "") -> bool:
    """Whether a TPU is named or visibly attached, without touching the network."""
    return bool(name or os.environ.get("TPU_NAME") or attached())


def attached() -> bool:
    """Whether this machine has TPU chips of its own (a TPU VM)."""
    return any(os.path.exists(p) for p in _TPU_VM_DEVICE_FILES)


def initialize(name: str = "", zone: str = "", project: str = "", runtime: Runtime = None,
               lookup_timeout_s: float = LOOKUP_TIMEOUT_S):
    """Connects to the TPU `name` ('local' on a TPU VM) and initialises it.

    Returns `(resolver, topology)`. 'local' drives this VM's own chips; a
    name (or TPU_NAME) is looked up and connected to as a remote cluster,
    which is how one TensorFlow client drives every host of a pod slice.
    Any failure becomes one `UserError` that says what to check, because a
    stack trace from the TPU runtime rarely does.
    """
    import tensorflow as tf
    runtime = runtime or RUNTIME
    name = name or os.environ.get("TPU_NAME", "") or "local"
    try:
        resolver = _within(lookup_timeout_s, lambda: runtime.resolver_cls(
            tpu=name, zone=zone or None, project=project or None))
        if name != "local":
            runtime.connect_to_cluster(resolver)
        topology = runtime.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, OSError, tf.errors.OpError) as error:
        raise UserError(
            f"no TPU reachable as cluster.tpu={name!r} ({first_line(error)}); check the TPU "
            "name, zone and project, or set --config.cluster.strategy=auto to run "
            "on the CPU/GPUs of this machine") from None
    return resolver, topology


def _within(timeout_s: float, fn):
    """`fn()`, or TimeoutError after `timeout_s` (the call is left behind in a daemon thread)."""
    outcome = {}

    def call():
        try:
            outcome["value"] = fn()
        except BaseException as error:  # re-raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=call, name="tpu-lookup", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"looking it up got no answer within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def accelerator_type(resolver=None, runtime: Runtime = None) -> str:
    """The slice type, such as 'v4-32', or '' when nothing says.

    Asked in order: TPU_ACCELERATOR_TYPE, this TPU VM's metadata server,
    then the Cloud TPU API through a resolver that looked a TPU up by name.
    """
    runtime = runtime or RUNTIME
    if os.environ.get(ACCELERATOR_TYPE_ENV):
        return os.environ[ACCELERATOR_TYPE_ENV].strip()
    found = runtime.metadata_accelerator_type()
    client = getattr(resolver, "_cloud_tpu_client", None)
    if not found and client is not None and hasattr(client, "accelerator_type"):
        try:
            found = _within(LOOKUP_TIMEOUT_S, client.accelerator_type) or ""
        except Exception:  # pylint: disable=broad-except  # a name is a nicety, not a need
            found = ""
    return found


def device_kind(resolver=None, runtime: Runtime = None) -> str:
    """A readable accelerator name such as 'TPU v4-32' (just 'TPU' when the type is unknown)."""
    found = accelerator_type(resolver, runtime)
    return f"TPU {found}" if found else "TPU"
