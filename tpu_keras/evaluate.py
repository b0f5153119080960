"""Evaluate a run's checkpoints as a job of its own: `python -m tpu_keras.evaluate --workdir=DIR`.

Evaluates the newest checkpoint of the run in DIR (or `--step=N`) on the
run's eval split, prints the metrics and writes them to
`DIR/tensorboard/eval/` at that step; `--watch` follows a run that is
still training, evaluating each new checkpoint once until its last step.
The run's `config.json` says what to build; `--config.KEY=VALUE` changes
it for this job, e.g. another cluster or mesh (`--config.mesh.model=2`). On
the jax engine a run's mesh that this job's devices do not fit is fitted to
them (its model and fsdp axes as far as they divide, the rest on data), unless
the command line sets the mesh.
`tpu_keras.training.evaluation` does the work.
"""

import os
import sys

from absl import flags, logging
from ml_collections import config_flags

from tpu_keras import cli
from tpu_keras import config as config_lib
from tpu_keras.errors import UserError
from tpu_keras.training import evaluation

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder (its config.json and checkpoints).")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint to evaluate; default: the newest.")
_WATCH = flags.DEFINE_boolean("watch", False, "Follow the run: evaluate every new checkpoint "
                              "once, oldest first, until the run's last step.")
_POLL = flags.DEFINE_float("poll_seconds", 30.0, "With --watch: seconds between looks for a new checkpoint.")
# Changes to the run's config for this job; only the keys given on the command line count.
_OVERRIDES = config_flags.DEFINE_config_dict("config", config_lib.defaults())


def main(argv):
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {argv[1:]}")
    if not _WORKDIR.value:
        raise UserError("give --workdir=DIR, the folder of a run of python -m tpu_keras.train")
    if _STEP.value is not None and _WATCH.value:
        raise UserError("--step and --watch exclude each other; give one")
    logging.set_verbosity(logging.INFO)
    cli.own_info_only()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    config = config_lib.read_run_config(_WORKDIR.value)
    given = _given_keys(sys.argv[1:])
    for key in given:
        *sections, name = key.split(".")
        source, target = _OVERRIDES.value, config
        for section in sections:
            source, target = source[section], target[section]
        target[name] = source[name]
    evaluation.evaluate(config, _WORKDIR.value, step=_STEP.value, watch=_WATCH.value,
                        poll_seconds=_POLL.value,
                        refit_mesh=not any(key.startswith("mesh.") for key in given))
    cli.exit_at_once(0)


def _given_keys(args) -> list:
    """The KEY of each --config.KEY=VALUE (or --config.KEY VALUE) on the command line."""
    return [arg[len("--config."):].split("=", 1)[0] for arg in args if arg.startswith("--config.")]


if __name__ == "__main__":
    cli.start(main)
