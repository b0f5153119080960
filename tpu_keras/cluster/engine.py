"""Choose the engine - Keras 3 on TensorFlow (`tf`) or on JAX (`jax`) - before Keras loads.

Keras reads `KERAS_BACKEND` once, when it is first imported, and JAX fixes its
fake CPU device count (`--xla_force_host_platform_device_count`) when it
starts. So `select()` must run before either is imported: `python -m
tpu_keras.train` calls it first thing. Code that imports Keras itself sets
`KERAS_BACKEND` instead, and `connect()` checks that the two agree.

On the tf engine it also keeps TensorFlow's CPU memory between steps
(`keep_cpu_memory`), which must happen before TensorFlow's first tensor; on
the jax engine, off a TPU, it keeps JAX from loading the TPU runtime for
nothing (`cpu_only_jax`).
"""

# Imported inside functions: Keras (the engine must be selected first: engine.select).
import contextlib
import importlib.util
import os
import sys

from tpu_keras.cluster import tpu
from tpu_keras.errors import UserError, closest

ENGINES = {"tf": "tensorflow", "jax": "jax"}  # engine -> Keras backend
# Set by `python -m tpu_keras.launch`: logical devices per simulated host.
VIRTUAL_DEVICES_ENV = "TPU_KERAS_VIRTUAL_DEVICES"
# Set by `python -m tpu_keras.launch --slices=S`: the simulated slices, and this host's.
NUM_SLICES_ENV, SLICE_ENV = "TPU_KERAS_NUM_SLICES", "TPU_KERAS_SLICE"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# XLA:CPU's default scheduler runs independent ops side by side, so every all-gather of an
# fsdp-split weight starts at once and each fake device holds the whole model: a LoRA step
# of a 0.85B Llama over 4 devices held 13 GiB of gathered weights. The other keeps to what
# a TPU's memory-aware scheduler does: 0.3 of the temporaries on a small model, same values.
_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
# TensorFlow reads these when it makes its CPU allocator, at its first tensor.
CPU_ALLOCATOR_ENV, CPU_MEMORY_LIMIT_ENV = "TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB"


def select(engine: str, virtual_devices: int = 0) -> None:
    """Makes Keras use `engine`'s backend; on jax, fakes `virtual_devices` CPU devices."""
    check_name(engine)
    backend = ENGINES[engine]
    if engine == "tf":
        keep_cpu_memory()
    if "keras" in sys.modules:
        if current() != engine:
            raise UserError(f"engine={engine!r} needs KERAS_BACKEND={backend}, but Keras was "
                            f"already imported with the {current_backend()} backend; select "
                            "the engine before importing keras")
        return
    os.environ["KERAS_BACKEND"] = backend
    if engine == "jax":
        cpu_only_jax()
    count = virtual_devices or int(os.environ.get(VIRTUAL_DEVICES_ENV, 0) or 0)
    if engine == "jax" and count > 1 and "jax" not in sys.modules:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
        if not any(flag.startswith(_SCHEDULER_FLAG) for flag in flags):  # the user's stands
            flags.append(f"{_SCHEDULER_FLAG}=false")
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_COUNT_FLAG}={count}"])


def cpu_only_jax() -> None:
    """Keeps JAX to its CPU backend where libtpu is installed but no TPU or GPU is attached.

    JAX loads the TPU runtime whenever it is installed (the `tpu` extra), only
    to find no chip: a third of a second per process, warnings about
    variables only a TPU VM sets, and a lock that lets one process at a time
    hold libtpu (`cluster.libtpu` reads slice descriptions without it). A
    `JAX_PLATFORMS` the user set stands.
    """
    if "JAX_PLATFORMS" in os.environ or "jax" in sys.modules or tpu.attached():
        return
    if importlib.util.find_spec("libtpu") is None or any(map(os.path.exists, _GPU_DEVICE_FILES)):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"


_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver, AMD's (ROCm)


def keep_cpu_memory() -> None:
    """Makes TensorFlow's CPU allocator keep freed memory for reuse (its BFC allocator),
    unless `TF_CPU_ALLOCATOR_USE_BFC` is already set.

    The default allocator returns every large buffer to the OS when it is
    freed. An XLA step's scratch buffer is one (140 MB for the default gpt), so
    the kernel maps and zeroes it anew on every step: on a 2-core CPU that
    was a third of the gpt's step on one device, and 40% of it on four
    replicas (docs/performance.md). The BFC allocator keeps what it has
    mapped, so the peak stays resident (here 5% more); it may grow to the
    machine's memory rather than its 64 GB default. It serves only tensors
    on the host: on a GPU or TPU, the input pipeline's.
    """
    global _ALLOCATOR_SET_LATE
    if CPU_ALLOCATOR_ENV not in os.environ:
        os.environ[CPU_ALLOCATOR_ENV] = "true"
        _ALLOCATOR_SET_LATE = tensorflow_started()
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        megabytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
        os.environ.setdefault(CPU_MEMORY_LIMIT_ENV, str(megabytes))


# Whether `keep_cpu_memory` set the variable after TensorFlow had made its allocator.
_ALLOCATOR_SET_LATE = False


def keeps_cpu_memory() -> bool:
    """Whether TensorFlow's CPU allocator is the BFC one, known from what was asked for.

    `TF_CPU_ALLOCATOR_USE_BFC` as TensorFlow reads it ('true' or '1', any
    case), unless `keep_cpu_memory` set it after TensorFlow had started.
    TensorFlow is not asked: on some x86 machines
    `tf.config.experimental.get_memory_info("CPU:0")` answers under either
    allocator (TensorFlow 2.21), so it cannot tell them apart.
    """
    wanted = os.environ.get(CPU_ALLOCATOR_ENV, "").strip().lower() in ("true", "1")
    return wanted and not _ALLOCATOR_SET_LATE


def tensorflow_started() -> bool:
    """Whether TensorFlow's runtime, and so its CPU allocator, exists yet: it is made with
    the eager context, at the first op, not at import (TensorFlow 2.21)."""
    context = sys.modules.get("tensorflow.python.eager.context")
    handle = context.context_safe() if context else None
    return bool(getattr(handle, "_initialized", False))


@contextlib.contextmanager
def keras_settings_kept():
    """Keras's process-wide dtype policy and `keras.distribution` as they were, after the block.

    A plan builds models as a run would, which sets both; a notebook or a
    second command in the same process must not inherit the planned slice's
    mesh (an optimizer slot would then be placed by its own path, against
    rules that name only the weights).
    """
    import keras
    policy, distribution = keras.config.dtype_policy(), keras.distribution.distribution()
    try:
        yield
    finally:
        keras.config.set_dtype_policy(policy)
        keras.distribution.set_distribution(distribution)


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
