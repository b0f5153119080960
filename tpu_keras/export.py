"""Export a run's checkpoint: `python -m tpu_keras.export --workdir=DIR [--step=N]`.

Writes what a run writes at its end (DIR/export/: a keras-hub preset, a
transformers folder, a LoRA run's factors and PEFT adapter, the SavedModel; see
`tpu_keras.models.export`) from any committed checkpoint: the newest, or
that of --step. The model is rebuilt from DIR/config.json in this host's
memory (the CPU device, not the accelerators) and the checkpoint restored
into it, so it serves runs of any mesh and any number of hosts (a run on
several jax hosts leaves its keras-hub exports to this command). A format
the model's family has no exporter for is one `error:` line and exit 2,
after the other formats are written.
"""

# Imported inside functions: Keras (the engine must be selected first: engine.select); NumPy
# (start-up time: not every caller needs it).
import os

from absl import flags, logging

from tpu_keras import cli
from tpu_keras import config as config_lib
from tpu_keras.errors import UserError
from tpu_keras.training import restored

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder (its config.json and checkpoints).")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint to export; default: the newest.")
_FORMATS = flags.DEFINE_list("formats", None, "Formats to write (saved_model, keras_hub, "
                             "transformers, lora, peft); default: the run's export.formats.")


def main(argv):
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {argv[1:]}")
    if not _WORKDIR.value:
        raise UserError("give --workdir=DIR, the folder of a run of python -m tpu_keras.train")
    logging.set_verbosity(logging.WARNING)
    config = config_lib.read_run_config(_WORKDIR.value)
    if _FORMATS.value is not None:
        config.export.formats = tuple(_FORMATS.value)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # host memory: never the accelerators
    run, step = restored.load(_WORKDIR.value, config, _STEP.value, purpose="export")
    from tpu_keras.models import export, preference  # Keras: once the setup selected the engine
    config, export_dir = run.config, os.path.join(_WORKDIR.value, "export")
    problems = export.write(preference.policy_of(run.model), config, export_dir)
    print(f"exported step {step} of {config.model.name} to {export_dir}")
    if problems:
        raise UserError("; ".join(problems))
    cli.exit_at_once(0)


if __name__ == "__main__":
    cli.start(main)
