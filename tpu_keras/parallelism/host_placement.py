"""Weights loaded from host memory straight into their shards (keras-team/keras#21634).

Keras on JAX fills a loaded weight (`variable.assign(numpy_value)`: how
keras-hub's preset loader and its transformers converters fill a backbone)
by first making the whole value an array on the default device and only
then laying it out; it also makes every weight below its 250 MB threshold
whole on that device when it initialises it. Under a distribution that
splits weights, each of them passes whole through one device, and a model
larger than a device's memory does not load (measured on 8 fake devices:
tests/load_memory_probe.py, figure in the README).

Inside `placed_from_host()` both go to the devices as their shards: a
numpy value assigned to a laid-out weight becomes
`jax.make_array_from_callback` over the host array (each device receives
its own slice, or the whole where the weight is replicated), and every
laid-out weight is initialised by a program whose outputs are already
split (Keras's own path for large weights); a weight's initial shards are
freed before its loaded ones arrive. A device then never holds more than
its own shards plus one replicated weight. Keras has no public hook for either step, so the scope
replaces the two for its duration; outside it Keras is unchanged.
"""

import contextlib


@contextlib.contextmanager
def placed_from_host():
    """Within: weights load and initialise shard by shard (no-op off the jax engine or with
    no `keras.distribution` set)."""
    import keras
    if keras.backend.backend() != "jax" or keras.distribution.distribution() is None:
        yield
        return
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

    variable_cls.assign = assign_from_host
    core.should_shard_at_init = lambda layout, shape: True
    try:
        yield
    finally:
        variable_cls.assign = assign
        core.should_shard_at_init = should_shard_at_init


def _shards_of(value, dtype, sharding):
    """`value` (host memory) laid out by `sharding`, each device given only its own slice."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    host = np.asarray(value, dtype=jnp.dtype(dtype))
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
