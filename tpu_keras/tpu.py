"""The TPU-only layer: find a TPU, connect to it, initialise it.

Kept thin on purpose: nothing here can run without a TPU, so everything else
in the toolkit talks to the `TPUStrategy` built from what this returns, and
tests exercise this boundary with a fake resolver.
"""

import os

import tensorflow as tf

from tpu_keras.errors import UserError

# On a TPU VM the chips are local character devices; v4 and older expose
# /dev/accel*, v5e and newer /dev/vfio/*.
_TPU_VM_DEVICE_FILES = ("/dev/accel0", "/dev/vfio/0")


def is_present(name: str = "") -> bool:
    """Whether a TPU is named or visibly attached, without touching the network."""
    return bool(name or os.environ.get("TPU_NAME")
                or any(os.path.exists(p) for p in _TPU_VM_DEVICE_FILES))


def initialize(name: str = "", zone: str = "", project: str = "",
               resolver_cls=tf.distribute.cluster_resolver.TPUClusterResolver):
    """Connects to the TPU `name` ('local' on a TPU VM) and initialises it.

    Returns `(resolver, topology)`. Any failure becomes one `UserError` that
    says what to check, because a stack trace from the TPU runtime rarely does.
    """
    name = name or os.environ.get("TPU_NAME", "") or "local"
    try:
        resolver = resolver_cls(tpu=name, zone=zone or None, project=project or None)
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


def device_kind(resolver) -> str:
    """A readable accelerator name such as 'TPU v4', from the resolver's metadata."""
    accelerator = getattr(resolver, "_accelerator_type", None) or "TPU"
    return f"TPU {accelerator}" if not accelerator.startswith("TPU") else accelerator
