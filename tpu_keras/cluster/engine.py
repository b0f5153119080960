"""Choose the engine - Keras 3 on TensorFlow (`tf`) or on JAX (`jax`) - before Keras loads.

Keras reads `KERAS_BACKEND` once, when it is first imported, and JAX fixes its
fake CPU device count (`--xla_force_host_platform_device_count`) when it
starts. So `select()` must run before either is imported: `python -m
tpu_keras.train` calls it first thing. Code that imports Keras itself sets
`KERAS_BACKEND` instead, and `connect()` checks that the two agree.
"""

import os
import sys

from tpu_keras.errors import UserError, closest

ENGINES = {"tf": "tensorflow", "jax": "jax"}  # engine -> Keras backend
# Set by `python -m tpu_keras.launch`: logical devices per simulated host.
VIRTUAL_DEVICES_ENV = "TPU_KERAS_VIRTUAL_DEVICES"
# Set by `python -m tpu_keras.launch --slices=S`: the simulated slices, and this host's.
NUM_SLICES_ENV, SLICE_ENV = "TPU_KERAS_NUM_SLICES", "TPU_KERAS_SLICE"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def select(engine: str, virtual_devices: int = 0) -> None:
    """Makes Keras use `engine`'s backend; on jax, fakes `virtual_devices` CPU devices."""
    check_name(engine)
    backend = ENGINES[engine]
    if "keras" in sys.modules:
        if current() != engine:
            raise UserError(f"engine={engine!r} needs KERAS_BACKEND={backend}, but Keras was "
                            f"already imported with the {current_backend()} backend; select "
                            "the engine before importing keras")
        return
    os.environ["KERAS_BACKEND"] = backend
    count = virtual_devices or int(os.environ.get(VIRTUAL_DEVICES_ENV, 0) or 0)
    if engine == "jax" and count > 1 and "jax" not in sys.modules:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_COUNT_FLAG}={count}"])


def check_name(engine: str) -> None:
    if engine not in ENGINES:
        raise UserError(f"engine={engine!r} is not one of {sorted(ENGINES)}{closest(engine, ENGINES)}")


def current_backend() -> str:
    import keras
    return keras.backend.backend()


def current() -> str:
    """The engine Keras is running on: 'tf' or 'jax' (or the backend name if neither)."""
    backend = current_backend()
    return next((engine for engine, name in ENGINES.items() if name == backend), backend)
