"""Weights loaded from host memory straight into their shards (keras-team/keras#21634).

Keras on JAX fills a loaded weight (`variable.assign(numpy_value)`: how
keras-hub's preset loader and its transformers converters fill a backbone)
by first making the whole value an array on the default device and only
then laying it out; it also makes every weight below its 250 MB threshold
whole on that device when it initialises it. Under a distribution that
splits weights, each of them passes whole through one device, and a model
larger than a device's memory does not load (measured on 8 fake devices:
tests/helpers/load_memory_probe.py, figure in docs/models.md).

Inside `placed_from_host()` both go to the devices as their shards: a
numpy value assigned to a laid-out weight becomes
`jax.make_array_from_callback` over the host array (each device receives
its own slice, or the whole where the weight is replicated), and every
laid-out weight is initialised by a program whose outputs are already
split (Keras's own path for large weights); a weight's initial shards are
freed before its loaded ones arrive. A device then never holds more than
its own shards plus one replicated weight.

`placed_from_host(loading=True)`, where the weights are read right after
the model is built (a preset's), skips the initialisation altogether. Keras
initialises a variable by running its initializer: an eager random op
compiled once per shape, or, split at init, a `jax.jit` compiled once per
variable. All of it is thrown away when the preset's weights arrive, and on
a TPU each compile costs a fraction of a second: hundreds for a large
model (here on the CPU, a two-layer Llama's 67 variables took 7 s of an 8 s
load, and 0.1 s without). Instead each variable starts as zeros, made shard
by shard on the host, and nothing is compiled. A variable the loader
leaves alone (a weight the preset does not hold) gets its initializer's
value on the way out, as Keras would have given it.

Keras has no public hook for any of this, so the scope replaces
`JaxVariable.assign`, `should_shard_at_init` and, when loading,
`JaxVariable._initialize_with_initializer` for its duration; outside it
Keras is unchanged.
"""

# Imported inside functions: Keras (the engine must be selected first: engine.select); JAX
# (optional: absent on a plain install; the tf engine runs without JAX); NumPy (start-up
# time: not every caller needs it).
import contextlib
import inspect


@contextlib.contextmanager
def placed_from_host(loading: bool = False):
    """Within: weights load and initialise shard by shard (with a `keras.distribution` set);
    with `loading`, variables start as zeros the caller then fills. No-op off the jax engine."""
    import keras
    if keras.backend.backend() != "jax":
        yield
        return
    distributed = keras.distribution.distribution() is not None
    with _split_on_assign() if distributed else contextlib.nullcontext():
        with _zeros_until_loaded() if loading else contextlib.nullcontext():
            yield  # a weight not loaded is initialised on the way out, still split


@contextlib.contextmanager
def _split_on_assign():
    import jax
    import numpy as np
    from keras.src.backend.jax import core  # where Keras decides both; no public hook

    variable_cls, assign = core.JaxVariable, core.JaxVariable.assign
    should_shard_at_init = core.should_shard_at_init

    def assign_from_host(variable, value):
        layout = getattr(variable, "_layout", None)
        if layout is not None and isinstance(value, np.ndarray):
            old = getattr(variable, "_value", None)
            if isinstance(old, jax.Array) and old.shape == value.shape and not old.is_deleted():
                variable._value = None  # the initial shards go before the loaded ones come
                old.delete()
            value = _shards_of(value, variable._dtype, getattr(layout, "backend_layout", layout))
        return assign(variable, value)

    initialize = variable_cls._initialize_with_initializer

    def initialize_any(variable, initializer):
        if inspect.isfunction(initializer):
            initializer = _Callable(initializer)
        return initialize(variable, initializer)

    variable_cls.assign = assign_from_host
    variable_cls._initialize_with_initializer = initialize_any
    core.should_shard_at_init = lambda layout, shape: True
    try:
        yield
    finally:
        variable_cls.assign = assign
        variable_cls._initialize_with_initializer = initialize
        core.should_shard_at_init = should_shard_at_init


class _Callable:
    """A function initializer as an object. Keras 3.15 splits a weight at init by jitting
    `initializer.__call__`, which for a plain function is a method-wrapper jax.jit refuses
    (`cannot create weak reference`): Dense's int4 `g_idx` under `model.quantize_block_size`."""

    def __init__(self, function):
        self._function = function

    def __call__(self, shape, dtype=None, **kwargs):
        return self._function(shape, dtype, **kwargs)


def _shards_of(value, dtype, sharding):
    """`value` (host memory) laid out by `sharding`, each device given only its own slice."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    host = np.asarray(value, dtype=jnp.dtype(dtype))
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@contextlib.contextmanager
def _zeros_until_loaded():
    """Variables made within are zeros, no program compiled; those still holding them on the
    way out get their initializer's value."""
    from keras.src.backend.jax import core
    initialize = core.JaxVariable._initialize_with_initializer
    placeholders = []

    def zeros(variable, initializer):
        variable._initialize_layout()
        variable._value = _zeros(variable._shape, variable._dtype, variable._layout)
        placeholders.append((variable, variable._value, initializer))

    core.JaxVariable._initialize_with_initializer = zeros
    try:
        yield
    finally:
        core.JaxVariable._initialize_with_initializer = initialize
    for variable, placeholder, initializer in placeholders:
        if variable._value is placeholder:  # not loaded: what Keras would have made
            initialize(variable, initializer)


def _zeros(shape, dtype, layout):
    """Zeros of `shape` with `layout`'s sharding (the default device's without one), placed
    as `_shards_of` places a loaded value: from one zero broadcast on the host, so no
    whole array is ever made."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    sharding = getattr(layout, "backend_layout", layout)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return _shards_of(np.broadcast_to(np.zeros((), jnp.dtype(dtype)), tuple(shape)), dtype, sharding)


def from_one_host(value, owner: int, variable):
    """The value of `variable` that process `owner` alone holds in host memory (`value`; None
    on every other process), laid out as the variable is on every process's devices: a
    weight read by one host of a multi-host run (`models.quantized.WhileLoading`).

    Each process contributes a row of an array split over the processes (the owner's value,
    the others' zeros, broadcast from one zero: no host memory), and one program picks the
    owner's row into the variable's layout: the compiler sends each device its slice. A
    device holds one whole value while it runs, as `placed_from_host` allows."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    shape, dtype = tuple(variable.shape), jax.numpy.dtype(variable.dtype)
    layout = getattr(variable, "_layout", None)
    sharding = getattr(layout, "backend_layout", layout)
    hosts = jax.process_count()
    by_host = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))).reshape(hosts, -1)
    if sharding is None:
        sharding = NamedSharding(Mesh(by_host, ("hosts", "local")), PartitionSpec())
    if set(sharding.device_set) != set(by_host.flat):
        raise ValueError(f"{variable.path} is laid out on {len(sharding.device_set)} of the "
                         f"{by_host.size} devices; a weight read by one host is placed on all")
    if value is None:
        row = np.broadcast_to(np.zeros((), dtype), (1, *shape))
    else:
        row = np.asarray(value, dtype=dtype).reshape((1, *shape))
    rows = jax.make_array_from_callback(
        (hosts, *shape), NamedSharding(Mesh(by_host, ("hosts", "local")), PartitionSpec("hosts")),
        lambda index: row[(slice(None),) + tuple(index[1:])])
    return _row_picker(owner, sharding)(rows)


_PICKERS = {}


def _row_picker(owner: int, sharding):
    """A program that takes row `owner` of its argument, laid out by `sharding` (one per pair:
    JAX compiles it once per shape)."""
    import jax
    key = (owner, sharding)
    if key not in _PICKERS:
        _PICKERS[key] = jax.jit(lambda rows: rows[owner], out_shardings=sharding)
    return _PICKERS[key]
