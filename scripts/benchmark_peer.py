"""Plain Keras's side of `benchmark.py --fit`: a second process, as a plain-Keras user runs it.

The toolkit sets process-wide things before TensorFlow starts (its CPU
allocator, `tpu_keras.cluster.engine.keep_cpu_memory`), and a model in the
toolkit's process would get them too. So plain Keras's models live in a
process of their own, with TensorFlow's default allocator, on the same
device layout, and train on the same batch from the same initial weights,
which the toolkit's process hands over in a .npz file. The two processes
take turns: the toolkit's process sends a model's name on the peer's stdin
and waits for its rate on stdout, so only one of them trains at a time.
"""

import json
import os
import subprocess
import sys

import benchmark_timing as timing
from tpu_keras.cluster import engine

_REPLY = "PEER "  # the peer's own stdout lines; anything else there is noise


class PlainKerasPeer:
    """The plain-Keras process for one config on one device layout; `rate(name)` runs a turn."""

    def __init__(self, mode: str, config_name: str, handover: str, seconds: float):
        env = dict(os.environ, **{engine.CPU_ALLOCATOR_ENV: "false"})  # TensorFlow's default
        self._process = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), "benchmark.py"), "--fit",
             f"--one_mode={mode}", f"--configs={config_name}", f"--fit_peer={handover}",
             f"--seconds={seconds}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.models = self._reply()  # {name: {steps_per_execution, xla}}, once it is ready

    def rate(self, name: str) -> float:
        self._process.stdin.write(name + "\n")
        self._process.stdin.flush()
        reply = self._reply()
        if "error" in reply:
            raise timing.TurnFailed(reply["error"])
        return reply["rate"]

    def close(self):
        self._process.stdin.close()
        self._process.wait(timeout=120)

    def _reply(self):
        for line in self._process.stdout:
            if line.startswith(_REPLY):
                return json.loads(line[len(_REPLY):])
        raise RuntimeError(f"the plain-Keras process exited {self._process.wait()} before replying")


def hand_over(path: str, weights, batch) -> None:
    """Writes the initial weights and the batch, in order, for the peer."""
    import numpy as np
    import tensorflow as tf
    arrays = {f"w{i}": w for i, w in enumerate(weights)}
    arrays.update({f"b{i}": np.asarray(t) for i, t in enumerate(tf.nest.flatten(batch))})
    np.savez(path, **arrays)


def receive(path: str, models: dict, batch_like):
    """Loads the handover's weights into every model; returns its batch.

    `batch_like` is a batch of the same structure (the peer's own first
    batch), which the .npz file's flat arrays are packed into.
    """
    import numpy as np
    import tensorflow as tf
    with np.load(path) as handed:
        weights = [handed[f"w{i}"] for i in range(sum(k.startswith("w") for k in handed))]
        leaves = [handed[f"b{i}"] for i in range(len(tf.nest.flatten(batch_like)))]
    for model in models.values():
        model.set_weights(weights)
    return tf.nest.pack_sequence_as(batch_like, leaves)


def serve(models: dict, turns: dict) -> None:
    """The peer's loop: says it is ready, then runs `turns[name]()` for each name on stdin."""
    _say({name: timing.settings(model) for name, model in models.items()})
    for line in sys.stdin:
        try:
            _say({"rate": turns[line.strip()]()})
        except Exception as error:  # noqa: BLE001 - plain Keras fails under some strategies
            _say({"error": timing.first_reason(error)})


def _say(reply) -> None:
    print(_REPLY + json.dumps(reply), flush=True)
