"""How a training run ends, whatever its loop (`training.loop`'s fit, GRPO's): the last save
waited for, the weights' fingerprint, the export to DIR/export/."""

# Imported inside functions: Keras (the engine must be selected first: engine.select).
import os

from absl import logging


def wait_for_the_last_save(checkpointer, run_timings, failing=False):
    """Returns once the run's last save is committed. A lost one is the run's error, or,
    when the run is already failing (or preempted), one line beside that error."""
    from tpu_keras.training import background
    try:
        with run_timings.phase("checkpoints"):
            checkpointer.wait()
    except background.SaveLost as lost:
        if not failing:
            raise
        logging.error("%s", lost)
    finally:
        if checkpointer.writer:
            run_timings.background = {"checkpoint_writes": checkpointer.writer.background_seconds,
                                      "checkpoint_waits": checkpointer.writer.waiting_seconds}


def export(model, config, workdir, cluster):
    """DIR/export/ (tpu_keras.models.export), on the chief. A format the model's family has
    no exporter for is a warning: the run itself succeeded, and the others are written."""
    from tpu_keras.models import export as exporter
    chosen = exporter.formats(config, exporter.find_task(model))
    if cluster.engine == "jax" and cluster.num_processes > 1 and set(chosen) - {"saved_model"}:
        # Another host's shards are out of the chief's reach; the export command reads
        # them from the final checkpoint instead, into one host's memory.
        logging.warning("export: %s from a run on %d hosts: run python -m tpu_keras.export "
                        "--workdir=%s on one host", ", ".join(chosen), cluster.num_processes, workdir)
        chosen = tuple(name for name in chosen if name == "saved_model")
    if not cluster.is_chief or not chosen:
        return
    for problem in exporter.write(model, config, os.path.join(workdir, "export"), chosen):
        logging.warning("export: %s", problem)


def fingerprint(model) -> float:
    """The sum of all weights, computed where they live (sharded jax arrays span hosts); a
    bfloat16 one's in float32 (a LoRA run's frozen base): its own sum rounds, and TensorFlow
    cannot hand NumPy a bfloat16 scalar."""
    import keras

    def total(value):
        if keras.backend.standardize_dtype(value.dtype) == "bfloat16":
            value = keras.ops.cast(value, "float32")
        return float(keras.ops.convert_to_numpy(keras.ops.sum(value)))
    return sum(total(w.value) for w in model.weights)
