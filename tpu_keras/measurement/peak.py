"""The peak FLOP/s that MFU divides by.

On CPU and GPU there is no honest published figure for "this machine", so
the peak is a matmul ceiling measured once - a large square matmul in the
run's dtype, timed at its best - and cached per machine, backend and dtype
under `~/.cache/tpu_keras` (or `$TPU_KERAS_CACHE_DIR`: the test suite keeps
its own, since a ceiling measured on a loaded machine would overstate every
later MFU). `TPU_KERAS_PEAK_FLOPS` overrides it (FLOP/s for the whole run). On TPU the peak is the published bf16 figure per device from
`tpu_keras.cluster.topology`, the rate MFU is conventionally quoted against.
"""

# Imported inside functions: TensorFlow (the engine must be selected first: engine.select); JAX
# (optional: absent on a plain install; the tf engine runs without JAX).
import json
import os
import platform
import time

from absl import logging

from tpu_keras import workdir
from tpu_keras.cluster import topology

PEAK_ENV = "TPU_KERAS_PEAK_FLOPS"
CACHE_DIR_ENV = "TPU_KERAS_CACHE_DIR"

# Published dense bf16 Tensor Core peaks per GPU, by a piece of JAX's `device_kind`
# (lower case; the first match counts, so the longer names come first). NVIDIA's
# datasheets give bf16 "with sparsity"; the dense peak is half of it.
GPU_BF16_PEAKS = (
    # https://www.nvidia.com/en-us/data-center/h200/ : H200 NVL 1,671 TFLOPS sparse;
    # H200 SXM 1,979 TFLOPS sparse (device_kind "NVIDIA H200").
    ("h200 nvl", 835.5e12),
    ("h200", 989.5e12),
    # https://www.nvidia.com/en-us/data-center/h100/ : H100 PCIe 1,513, H100 NVL 1,671,
    # H100 SXM 1,979 TFLOPS sparse (device_kind "NVIDIA H100 80GB HBM3" for SXM).
    ("h100 pcie", 756.5e12),
    ("h100 nvl", 835.5e12),
    ("h100", 989.5e12),
    # https://www.nvidia.com/en-us/data-center/a100/ : BF16 Tensor Core 312 TFLOPS dense
    # (624 sparse), SXM and PCIe, 40 and 80 GB alike.
    ("a100", 312e12),
)


def published_bf16_peak(device_kind: str) -> float:
    """The published dense bf16 FLOP/s of one device of `device_kind` (0.0 when unknown).

    TPUs: `tpu_keras.cluster.topology` (each generation's figure, with its
    source); GPUs: `GPU_BF16_PEAKS`.
    """
    tpu = topology.generation_of_device_kind(device_kind)
    if tpu is not None:
        return tpu.peak_flops_per_device
    kind = device_kind.lower()
    return next((peak for name, peak in GPU_BF16_PEAKS if name in kind), 0.0)


def peak_flops(cluster, dtype: str = "float32") -> float:
    """FLOP/s all of the run's devices can do at best (0.0 when unknown, e.g. an unknown TPU)."""
    if os.environ.get(PEAK_ENV):
        return float(os.environ[PEAK_ENV])
    device = cluster.device_kind
    devices = cluster.num_replicas * cluster.mesh["model"]
    tpu = topology.generation_of_device_kind(device)
    if tpu is not None:
        return devices * tpu.peak_flops_per_device
    if cluster.kind == "tpu":
        return 0.0
    # Logical CPU devices share one machine's cores: one ceiling per host.
    units = cluster.num_hosts if "CPU" in device.upper() else devices
    return units * matmul_ceiling(dtype, cluster.engine, device)


def matmul_ceiling(dtype: str, engine: str, device_kind: str) -> float:
    """Best FLOP/s of one 2048 x 2048 matmul on one device, measured once and cached."""
    key = f"{engine}/{device_kind}/{platform.processor() or platform.machine()}/{dtype}"
    cache = _read_cache()
    if key not in cache:
        cache[key] = measure_matmul(dtype, engine)
        logging.info("measured the %s matmul ceiling: %.3g FLOP/s (cached in %s)", dtype, cache[key],
                     cache_file())
        _write_cache(cache)
    return cache[key]


def measure_matmul(dtype: str, engine: str, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` n x n matmuls (after a warm-up), uncached."""
    if engine == "jax":
        import jax
        import jax.numpy as jnp
        a = jnp.ones((n, n), dtype)
        matmul = jax.jit(lambda x: x @ x)
        run = lambda: matmul(a).block_until_ready()
    else:
        import tensorflow as tf
        a = tf.ones((n, n), dtype)
        run = lambda: tf.linalg.matmul(a, a).numpy()
    run()  # warm-up: compilation, thread pools
    best = min(_timed(run) for _ in range(repeats))
    return 2 * n ** 3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cache_file() -> str:
    folder = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "tpu_keras")
    return os.path.join(folder, "matmul_ceiling.json")


def _read_cache() -> dict:
    try:
        with open(cache_file()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict) -> None:
    path = cache_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        workdir.write_whole(path, json.dumps(cache, indent=1))  # concurrent hosts never read half a file
    except OSError as error:
        logging.warning("cannot cache the matmul ceiling in %s: %s", path, error)
