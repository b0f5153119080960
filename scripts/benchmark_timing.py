"""What benchmark.py and the scripts it runs share: configs by name, the rate of `fit`'s
executions, a jitted function's median time, one TPU chip as libtpu describes it, and the
race of several models in turns.

No flags here: both scripts import it (benchmark.py defines the flags).
"""

import statistics
import time


def config_by_name(name):
    """The config of `module` or `module:variant` under configs/ (as --config=path:variant)."""
    import importlib
    module, _, variant = name.partition(":")
    return importlib.import_module(module).get_config(variant or None)


def median_seconds(function, arguments, seconds: float) -> float:
    """The median time of `function(*arguments)` (a jitted JAX function) over `seconds`, at
    least 3 calls, after one that compiles it."""
    import jax
    jax.block_until_ready(function(*arguments))  # compiled
    times, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds or len(times) < 3:
        began = time.perf_counter()
        jax.block_until_ready(function(*arguments))
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def one_tpu_chip():
    """A NamedSharding of one TPU v5e chip as libtpu describes it (no chip needed): what a
    program is compiled for to read the TPU compiler's figures."""
    import jax
    import numpy as np
    from tpu_keras.cluster import libtpu
    chip = jax.sharding.Mesh(np.array(libtpu.devices("v5litepod-8")[:1]), ("one",))
    return jax.sharding.NamedSharding(chip, jax.sharding.PartitionSpec())


class TurnFailed(Exception):
    """A turn failed in another process; the message is already its `first_reason`."""


def first_reason(error) -> str:
    """The error's type and its message's first 300 characters, in one line (not parsed)."""
    kind = "" if isinstance(error, TurnFailed) else f"{type(error).__name__}: "
    return kind + " ".join(str(error).split())[:300]


def training_rate(model, dataset, batch, seconds):
    """examples/s of `model.fit`'s training loop: the median execution, after one fit that compiles.

    Each call to the train function is timed from a callback, so what `fit`
    does before the first step and after the last is left out. That matters:
    TensorFlow's input iterators can take seconds to delete when `fit`
    returns (the tf.data autotuner's thread of each per-device iterator is
    waited for), a cost per `fit` call rather than per step that would
    otherwise fall on whichever variant happened to pay it.
    """
    import keras

    class CallTimes(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    timer = CallTimes()
    steps_per_execution = model.steps_per_execution

    def call_times(executions):
        timer.times = []
        model.fit(dataset, epochs=1, steps_per_epoch=executions * steps_per_execution, verbose=0,
                  callbacks=[timer])
        return timer.times
    one_call = call_times(2)[-1]  # the first call traces and compiles; the second is one call
    executions = max(3, round(seconds / one_call))  # timed calls that last about `seconds`
    return steps_per_execution * batch / statistics.median(call_times(executions))



def race(turns: dict, rounds: int) -> dict:
    """{name: [examples/s of each of its `rounds` turns], or the error's one line if it fails}.

    `turns[name]()` runs one turn of that model and returns its examples/s
    (`training_rate` here, or a turn in another process). The models take
    turns in the order `turn_order` gives each round. A shared machine's
    speed drifts (here by up to 20% over a few minutes), and in a fixed order
    the model that always went last gained on the one that always went first;
    and a model's turn may be sped or slowed by the one just before it (with
    four models in a plain rotation, hand-tuned Keras always came right after
    Keras's defaults, and the toolkit right after hand-tuned Keras). With
    `rounds` a multiple of the number of models (twice it for an odd number),
    each goes first, second, ... equally often, and right after each of the
    others equally often.
    """
    names = list(turns)
    rates, errors = {name: [] for name in names}, {}
    for turn in range(rounds):
        for name in turn_order(names, turn):
            if name in errors:
                continue
            try:
                rates[name].append(turns[name]())
            except Exception as error:  # noqa: BLE001 - plain Keras fails under some strategies
                errors[name] = first_reason(error)
    return {name: errors.get(name) or rates[name] for name in names}


def settings(model) -> dict:
    """What the JSON says of how a model trains: its steps per execution, and whether XLA runs."""
    return {"steps_per_execution": model.steps_per_execution, "xla": bool(model.jit_compile)}


def training_turns(models: dict, dataset, batch: int, seconds: float) -> dict:
    """`race`'s turns for models in this process: each a `training_rate` on `dataset`."""
    return {name: (lambda model=model: training_rate(model, dataset, batch, seconds))
            for name, model in models.items()}


def turn_order(names: list, turn: int) -> list:
    """Round `turn` of a Williams design: over n rounds (2n for odd n) every name takes
    every place once, and follows every other name once, so neither the place in a round
    nor the model run just before favours one."""
    n = len(names)
    base = [(i + 1) // 2 if i % 2 else -(i // 2) % n for i in range(n)]  # 0, 1, n-1, 2, n-2, ...
    order = [names[(index + turn) % n] for index in base]
    return order[::-1] if n % 2 and (turn // n) % 2 else order
