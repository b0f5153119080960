"""Find the hardware and describe it as a `Cluster`: a tf.distribute strategy or a jax mesh.

`connect(config.cluster)` is the only entry point. On the tf engine it
builds the strategy that fits (`tf_engine`): with `strategy='auto'`, in
order, a TPU, TF_CONFIG multi-worker, several local devices (mirrored), one
device. On the jax engine it joins the run's processes and lays the devices
out on the `(data, fsdp, expert, context, model)` mesh (`jax_engine`). Only the chosen engine's
module is imported. Everything above this package sees a `Cluster` and never
asks which of those it got.
"""

# Imported inside functions: Keras and TensorFlow (the engine must be selected first:
# engine.select); JAX (optional: absent on a plain install; the tf engine runs without
# JAX); and the engine-specific modules, which import this package back.
from typing import Optional

from absl import logging

from tpu_keras.cluster import engine as engine_lib
from tpu_keras.cluster.record import KINDS, STRATEGIES, Cluster
from tpu_keras.errors import UserError, closest

__all__ = ["KINDS", "STRATEGIES", "Cluster", "connect"]


def connect(config, *, engine: Optional[str] = None, mesh=None, refit_mesh: int = 0) -> Cluster:
    """Connects to the hardware described by a `cluster` config section.

    `engine` ('tf' or 'jax') defaults to the backend Keras runs on; `mesh`
    is the `config.mesh` section (default: every device on the data axis).
    `refit_mesh`: on jax, a global batch size: a mesh of fixed sizes these devices do not
    fit is fitted to them and to that batch (a job that reads a run made elsewhere).
    """
    strategy = config.get("strategy", "auto")
    if strategy not in STRATEGIES:
        raise UserError(f"cluster.strategy={strategy!r} is not one of {STRATEGIES}"
                        f"{closest(strategy, STRATEGIES)}")
    engine = engine or engine_lib.current()
    engine_lib.select(engine)  # a one-line error if Keras already runs another backend
    if engine == "jax":
        from tpu_keras.cluster import jax_engine
        cluster = jax_engine.connect(config, mesh, refit_mesh)
    else:
        from tpu_keras.cluster import tf_engine
        cluster = tf_engine.connect(config, mesh)
        if not engine_lib.keeps_cpu_memory():
            logging.info("TensorFlow's CPU allocator returns each XLA step's scratch memory to "
                         "the OS (it ran before tpu_keras could set %s=true, or that was set "
                         "to false): XLA steps on a CPU run slower", engine_lib.CPU_ALLOCATOR_ENV)
    logging.info("cluster: %s", cluster.describe())
    return cluster
