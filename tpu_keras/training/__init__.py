"""The training loop: step functions, the optimizer, checkpoints, callbacks and the run.

`loop.train` is the whole run, stage by stage. `setup.set_up` sets a run up
(config resolved once by `run_config`, cluster, model, checkpointer) for it,
for the evaluation job and for export and generate. `distributed_steps(model)`
gives any Keras model (yours too) the toolkit's train and test steps for its
engine: a host loop that works under every tf.distribute strategy on the tf
engine (`tf_steps`), the guarded step on jax (`jax_steps`). Both log the
global gradient norm and apply no update from a non-finite step.
"""

# Imported inside functions: Keras and TensorFlow (the engine must be selected first:
# engine.select); JAX (optional: absent on a plain install; the tf engine runs without
# JAX); and the engine-specific modules, which import this package back.


def distributed_steps(model, grad_accum_steps: int = 1):
    """Gives `model` step functions that work under any strategy (tf) or mesh (jax); returns it.

    Call it once, on a model built inside `cluster.scope()`, before `fit`.
    With `grad_accum_steps` k, each batch `fit` gives is k micro-batches whose
    mean gradient makes one update. (Keras is imported here, not above: a run
    selects its engine first.)
    """
    import keras
    if keras.backend.backend() == "jax":
        from tpu_keras.training import jax_steps
        return jax_steps.distributed_steps(model, grad_accum_steps)
    from tpu_keras.training import tf_steps
    return tf_steps.distributed_steps(model, grad_accum_steps)

