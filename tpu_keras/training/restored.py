"""A finished or running run's model rebuilt on this host's first device, a checkpoint restored.

`generate` and `export` read a run this way: `training.setup` sets the run up
on one device (`one_device`), whatever mesh and hosts it trained on (Orbax
and TensorFlow both reshard on restore), in the dtype policy the run trained
in; then the checkpoint is restored into it.
"""

from tpu_keras.errors import UserError
from tpu_keras.training import setup


def load(workdir: str, config, step=None, purpose: str = "export"):
    """(run, step): the run set up on one device (a `setup.RunSetup`: its model, its
    resolved config), the checkpoint of `step` (default: the newest) restored.

    `purpose` names the command in the error for a run with no checkpoint yet.
    """
    run = setup.set_up(config, workdir, one_device=True)
    checkpointer = run.checkpointer
    saved = checkpointer.saved_steps()
    if not saved:
        raise UserError(f"{workdir} has no checkpoint yet; {purpose} once the run has saved one")
    if step is None:
        return run, checkpointer.restore_latest()
    if step not in saved:
        raise UserError(f"--step={step} is not a checkpoint in {workdir}; its checkpoints are "
                        f"at steps {saved}")
    checkpointer.restore(step)
    return run, step
