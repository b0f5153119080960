"""Print where every weight of a config's model lives on its mesh.

    python -m tpu_keras.layout --config=configs/lm_stdlib.py \\
        --config.mesh.data=4 --config.mesh.model=2 [--json]

One row per weight (path, shape, layout, bytes per device), then parameter
and optimizer-state totals, in all and per device (`planning.layout_report`).
Nothing is allocated, so it answers for meshes far larger than this
machine; it needs the jax extra (`pip install -e ".[jax]"`) for that,
whichever engine the config trains on. The rules are checked as in
training: a rule that matches nothing, an indivisible split or an
uncovered large weight is a one-line error.
"""

import json
import math

from absl import flags, logging
from ml_collections import config_flags

from tpu_keras import cli
from tpu_keras import objectives
from tpu_keras.cluster import engine
from tpu_keras.errors import UserError
from tpu_keras.planning import layout_report

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/lm_stdlib.py")
_DEVICES = flags.DEFINE_integer("devices", 0, "Devices in the mesh; default: the product of the "
                                "config's fixed mesh axes (an axis of -1 counts as 1).")
_JSON = flags.DEFINE_bool("json", False, "Print the report as JSON.")


def main(argv):
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {argv[1:]}")
    if _CONFIG.value is None:
        raise UserError("--config=configs/<name>.py[:variant] is required")
    config = _CONFIG.value
    logging.set_verbosity(logging.WARNING)  # JAX's platform probing is not news here
    objectives.check(config)
    engine.select("jax")  # for the allocation-free build, whatever engine trains
    devices = _DEVICES.value or math.prod(size for size in dict(config.mesh).values() if size > 0)
    report = layout_report.layout_of(config, devices)
    print(json.dumps(report, indent=1) if _JSON.value else layout_report.format_table(report))


if __name__ == "__main__":
    cli.start(main)
