"""One training run, stage by stage: `train(config, workdir)`.

Reads top to bottom as the run goes: config -> cluster -> parallelism ->
model -> checkpoint -> steps -> export. Running it again on the same
workdir resumes from the latest checkpoint. `python -m tpu_keras.train` is
its command line; a notebook or a test can call `train` directly.

Its first stages (config, cluster, model, checkpointer) are `training.setup`'s,
which evaluation, export and generate share. The steps are the objective's
step source (Keras `fit`, `training.fit_steps`, unless the objective has its
own, as GRPO does), inside the outer loop every run shares
(`training.controller`: checkpoints, preemption, the non-finite guard, lost
hosts, profiles, the ending). Keras reads its backend once, when it is first
imported, so everything that imports Keras or TensorFlow is imported inside
`train`, after `setup` has selected the engine.
"""

# Imported inside functions: Keras and TensorFlow (the engine must be selected first:
# engine.select).
import time

from absl import logging

from tpu_keras.measurement import timings
from tpu_keras.training import setup


def train(config, workdir: str, started: float | None = None):
    """Runs (or resumes) one training run; returns its step source's result: the final
    Keras history (GRPO's: the last evaluation's figures).

    `started` (a `time.time()`) is when the run began, for its time breakdown;
    the command line passes the process's start, so imports count too.
    """
    started = time.time() if started is None else started
    if logging.get_verbosity() < logging.INFO:  # a script's own call: the log is the progress
        logging.set_verbosity(logging.INFO)

    # ----- config, cluster, model, checkpointer: training.setup -------------------
    run_timings = timings.RunTimings(started)
    run = setup.set_up(config, workdir, trains=True, timings=run_timings)
    from tpu_keras.training import controller, fit_steps
    logging.info("model: %s", setup.model_line(run.model, run.config))

    # ----- steps, inside the outer loop; the export ------------------------------
    outer = controller.Controller(run, workdir, run_timings)
    steps = run.objective.steps(run, workdir) or fit_steps.KerasFit(run, workdir, run_timings)
    return outer.run(steps)
