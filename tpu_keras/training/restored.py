"""A finished or running run's model rebuilt on this host's first device, a checkpoint restored.

`generate` and `export` read a run this way: whatever mesh and hosts it trained
on, its checkpoints restore into one device's model (Orbax and TensorFlow both
reshard on restore), in the dtype policy the run trained in.
"""

from tpu_keras.errors import UserError


def load(workdir: str, config, step=None, purpose: str = "export"):
    """(model, step): the run's model, the checkpoint of `step` (default: the newest) restored.

    `purpose` names the command in the error for a run with no checkpoint yet.
    """
    from tpu_keras import cluster as cluster_lib
    from tpu_keras import models
    from tpu_keras.training import checkpoint, defaults
    from tpu_keras.training.run import build_model

    models.hub.prepare_preset(config.model, workdir, is_chief=True)  # a {workdir} preset
    models.kept.use(config.model, workdir, checkpointed=True)  # the checkpoint's weights
    config.mesh.update(slices=1, data=1, fsdp=1, model=1)
    config.cluster.update(strategy="one_device" if config.engine == "tf" else "auto",
                          virtual_devices=0)
    cluster = cluster_lib.connect(config.cluster, engine=config.engine, mesh=config.mesh)
    defaults.resolve(config, cluster)  # the dtype policy the run trained in
    model = build_model(config, cluster)
    saver = checkpoint.open_checkpointer(workdir, model, cluster)
    saved = saver.saved_steps()
    if not saved:
        raise UserError(f"{workdir} has no checkpoint yet; {purpose} once the run has saved one")
    if step is None:
        return model, saver.restore_latest()
    if step not in saved:
        raise UserError(f"--step={step} is not a checkpoint in {workdir}; its checkpoints are "
                        f"at steps {saved}")
    saver.restore(step)
    return model, step
