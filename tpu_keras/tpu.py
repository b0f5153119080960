"""The TPU-only layer: find a TPU, connect to it, initialise it.

Kept thin on purpose: nothing here can run without a TPU, so everything else
in the toolkit talks to the `TPUStrategy` built from what this returns, and
tests exercise this boundary with a fake resolver.
"""

import os
import threading

import tensorflow as tf

from tpu_keras.errors import UserError

# On a TPU VM the chips are local character devices; v4 and older expose
# /dev/accel*, v5e and newer /dev/vfio/*.
_TPU_VM_DEVICE_FILES = ("/dev/accel0", "/dev/vfio/0")
# Looking a TPU up by name asks the GCE metadata server and the Cloud TPU API,
# with no timeout of their own: off Google Cloud that can hang for minutes.
LOOKUP_TIMEOUT_S = 60


def is_present(name: str = "") -> bool:
    """Whether a TPU is named or visibly attached, without touching the network."""
    return bool(name or os.environ.get("TPU_NAME")
                or any(os.path.exists(p) for p in _TPU_VM_DEVICE_FILES))


def initialize(name: str = "", zone: str = "", project: str = "",
               resolver_cls=tf.distribute.cluster_resolver.TPUClusterResolver,
               lookup_timeout_s: float = LOOKUP_TIMEOUT_S):
    """Connects to the TPU `name` ('local' on a TPU VM) and initialises it.

    Returns `(resolver, topology)`. Any failure becomes one `UserError` that
    says what to check, because a stack trace from the TPU runtime rarely does.
    """
    name = name or os.environ.get("TPU_NAME", "") or "local"
    try:
        resolver = _within(lookup_timeout_s, lambda: resolver_cls(
            tpu=name, zone=zone or None, project=project or None))
        if name != "local":
            tf.config.experimental_connect_to_cluster(resolver)
        topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, OSError, tf.errors.OpError) as error:
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise UserError(
            f"no TPU reachable as cluster.tpu={name!r} ({reason}); check the TPU "
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


def device_kind(resolver) -> str:
    """A readable accelerator name such as 'TPU v4', from the resolver's metadata."""
    accelerator = getattr(resolver, "_accelerator_type", None) or "TPU"
    return f"TPU {accelerator}" if not accelerator.startswith("TPU") else accelerator
