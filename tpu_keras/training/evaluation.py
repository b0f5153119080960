"""Evaluation as a job of its own: a run's checkpoints on the run's eval split.

`evaluate(config, workdir)` sets the run up again (`training.setup`, as the
run set itself up) on this job's cluster and mesh, which may differ from
training's: a checkpoint is restored onto whatever layout the model has
here. It restores checkpoints and runs the same `model.evaluate` that the
run's validation runs (a GRPO run's: the same sampling and rewards), so the
metrics at a step equal the run's own validation at that step. Each result
is printed and written to `WORKDIR/tensorboard/eval/` at its step, under
the run's own names (`val_loss`, ...), so TensorBoard draws both in one
chart.

With `watch`, the job follows the run as Model Garden's continuous eval
does: it evaluates every checkpoint once, oldest first, until the run's
last step; a checkpoint that `checkpoint.keep` deletes before its turn is
skipped with a warning.
"""

# Imported inside functions: Keras and TensorFlow (the engine must be selected first:
# engine.select); JAX (optional: absent on a plain install; the tf engine runs without
# JAX); NumPy (start-up time: not every caller needs it).
import os
import time

from absl import logging

from tpu_keras.errors import UserError
from tpu_keras.training import setup


def evaluate(config, workdir: str, step: int | None = None, watch: bool = False,
             poll_seconds: float = 30.0, refit_mesh: bool = True) -> dict:
    """Evaluates checkpoint `step` (the newest when None; every one from now on with
    `watch`); returns {step: {metric: value}}. TensorFlow loads once `setup` has
    selected the engine. `refit_mesh`: on jax, the run's mesh is fitted to this job's
    devices where it does not fit them (a mesh the user set for the job is not)."""
    run = setup.set_up(config, workdir, single_tf_process="evaluate", refit_mesh=refit_mesh)
    import tensorflow as tf
    from tpu_keras import data
    from tpu_keras.training import checkpoint
    cluster, config, model, checkpointer = run.cluster, run.config, run.model, run.checkpointer
    measure = run.objective.evaluation(run, workdir)  # GRPO's: completions sampled and scored
    if measure is None:
        eval_data, eval_steps = data.build(config.data, cluster, config.train.batch_size,
                                           training=False, max_eval_steps=config.train.eval_steps)

        def measure():
            metrics = model.evaluate(eval_data, steps=eval_steps, return_dict=True, verbose=0)
            return {f"val_{name}": float(value) for name, value in metrics.items()}
    writers = []  # the TensorBoard writer, made at the first result (chief only)

    def one(at: int) -> dict:
        checkpointer.restore(at)
        metrics = measure()
        print(f"step {at} | " + " | ".join(f"{k} {v:.7g}" for k, v in metrics.items()), flush=True)
        if cluster.is_chief and not writers:
            writers.append(tf.summary.create_file_writer(os.path.join(workdir, "tensorboard", "eval")))
        for writer in writers:
            with writer.as_default(step=at):
                for name, value in metrics.items():
                    tf.summary.scalar(name, value)
            writer.flush()
        return metrics

    results = {}
    saved = _agreed(checkpointer.saved_steps(), cluster)
    if not watch:
        if step is None and not saved:
            raise UserError(f"{checkpointer.shared_dir} holds no checkpoint yet; evaluate once the run "
                            "has saved one, or follow it with --watch")
        at = saved[-1] if step is None else step
        if at not in saved:
            raise UserError(f"step {at} is not saved in {checkpointer.shared_dir}; the saved steps are "
                            f"{', '.join(map(str, saved)) or 'none'}")
        results[at] = one(at)
    else:
        last, final = -1, config.train.steps
        logging.info("following %s until step %d", checkpointer.shared_dir, final)
        while last < final:
            for at in [s for s in saved if s > last]:
                try:
                    results[at] = one(at)
                except checkpoint.Unreadable as error:
                    logging.warning("skipped step %d: %s (deleted by checkpoint.keep before its "
                                    "turn?)", at, error)
                last = at
            if last < final:
                time.sleep(poll_seconds)
                saved = _agreed(checkpointer.saved_steps(), cluster)
    for writer in writers:
        writer.close()
    return results


def _agreed(steps: list, cluster) -> list:
    """The saved steps as process 0 sees them, on every process (they list the folder
    at slightly different times, and must restore the same checkpoints)."""
    if cluster.num_processes == 1:
        return steps
    import numpy as np
    from jax.experimental import multihost_utils
    fixed = np.full(1024, -1, np.int64)
    fixed[:len(steps[-1024:])] = steps[-1024:]
    return [int(s) for s in multihost_utils.broadcast_one_to_all(fixed) if s >= 0]
