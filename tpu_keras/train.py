"""Train a model from a config: `python -m tpu_keras.train --config=configs/x.py --workdir=DIR`.

Running the same command on the same workdir resumes from the latest
checkpoint. The run itself, stage by stage, is `tpu_keras.training.loop`;
this module is its command line. A mistake ends as one `error: ...` line
and exit code 2 (`cli`); a preempted run exits 42 after saving.
"""

import os
import sys
import warnings

from absl import flags, logging
from ml_collections import config_flags

from tpu_keras import cli
from tpu_keras.errors import Preempted, UserError
from tpu_keras.measurement import timings
from tpu_keras.training import loop

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/lm_stdlib.py:tiny")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json, checkpoints, TensorBoard "
                               "events and the exported SavedModel go (gs:// too).")


def main(argv):
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {argv[1:]}")
    if _CONFIG.value is None or not _WORKDIR.value:
        raise UserError("both --config=configs/<name>.py[:variant] and --workdir=DIR are required")
    logging.set_verbosity(logging.INFO)
    cli.own_info_only()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    warnings.filterwarnings("ignore", message=".*`shuffle=True` was passed.*")
    try:
        loop.train(_CONFIG.value, _WORKDIR.value, started=timings.process_start())
    except UserError as error:
        cli.fail(error, at_once=True)
    except Preempted as preempted:
        print(f"preempted: {preempted}", file=sys.stderr)
        cli.exit_at_once(Preempted.EXIT_CODE)
    cli.exit_at_once(0)


if __name__ == "__main__":
    cli.start(main)
