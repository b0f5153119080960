"""Preemption: SIGTERM makes a run save at the next step boundary and exit 42.

A TPU VM (and a spot VM, and Kubernetes) announces a preemption with
SIGTERM and kills the process some seconds later. `watch()` turns the
signal into a flag; `SaveOnPreemption` checks it after every execution,
saves a checkpoint of that step and raises `errors.Preempted`, which the
entry point turns into exit code 42 ("saved; run me again"). Run the same
command again and training resumes from that step.

Every host must stop at the same step - saving is collective under
MultiWorkerMirroredStrategy, and a host that ran ahead would wait forever
for its peers - so with several hosts the flag is summed over all hosts
after every execution, and all stop together when any got the signal.
TensorFlow's `PreemptionCheckpointHandler` is not used: it disables itself
on Cloud TPU VMs and GCE CPU VMs (it logs that it "does not support usage
with TPU or CPU device on GCP"), exactly where preemptions happen.
"""

# Imported inside functions: JAX (optional: absent on a plain install; the tf engine runs
# without JAX); TensorFlow (start-up time: not every caller needs it).
import signal
import threading

from absl import logging
import keras
import numpy as np

from tpu_keras.errors import Preempted

_signalled = threading.Event()


def watch() -> None:
    """Turns SIGTERM into a request to save and stop at the next step boundary."""
    signal.signal(signal.SIGTERM, lambda signum, frame: _signalled.set())


class SaveOnPreemption(keras.callbacks.Callback):
    """After each execution: if any host got SIGTERM, save on every host and raise `Preempted`.
    `steps_per_boundary`: only after a step that is a multiple of it, where a checkpoint
    may fall (GRPO's: the end of a batch of samples)."""

    def __init__(self, checkpointer, cluster, steps_per_boundary: int = 1):
        super().__init__()
        self._checkpointer, self._every = checkpointer, steps_per_boundary
        self._any_host = _any_host_fn(cluster)

    def on_train_batch_end(self, batch, logs=None):
        if self._every > 1 and self._checkpointer.step % self._every:
            return
        if self._any_host(_signalled.is_set()):
            if keras.backend.backend() == "jax":
                self.model.jax_state_sync()  # Keras's jax loop keeps the state apart until then
            logging.warning("preemption notice (SIGTERM): saving at step %d", self._checkpointer.step)
            self._checkpointer.save()
            raise Preempted(self._checkpointer.step)


def _any_host_fn(cluster):
    """`flag -> bool`: whether `flag` is set on any host (a collective when there are several)."""
    if cluster.num_processes == 1:
        return bool
    if cluster.strategy is None:  # jax
        from jax.experimental import multihost_utils
        return lambda flag: bool(multihost_utils.process_allgather(np.int32(flag)).max())

    import tensorflow as tf
    strategy = cluster.strategy

    @tf.function
    def total(flag):
        return strategy.reduce("SUM", strategy.run(lambda: tf.identity(flag)), axis=None)

    return lambda flag: bool(total(tf.constant(int(flag))) > 0)
