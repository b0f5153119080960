"""Will this config fit that TPU slice? Memory per device, before you pay for the slice.

    python -m tpu_keras.plan --config=configs/lm_stdlib.py --tpu=v5p-64 [--json]
    python -m tpu_keras.plan --config=configs/lm_stdlib.py --tpu=v4-32 \\
        --config.engine=jax --config.mesh.model=2 --config.train.batch_size=1024
    python -m tpu_keras.plan --config=configs/lm_stdlib.py:1b --tpu=v5p-64 --auto

Parameters, optimizer state and gradients per device are exact; activations
an estimate; the bytes sent per update are computed from the layout (see
`planning.slice_plan`). `--auto` tries every mesh and remat setting and
recommends a layout (`planning.layout_search`); with `--measure` on the TPU
compiler, it compiles the best few (`--compiled`) and the compiler's
figures choose. `--measure` compiles the
toolkit's real training step and prints the compiler's figures next to the
plan's: where libtpu is installed (the `tpu` extra), the TPU compiler's own
for the slice's devices, ahead of time on this machine and with nothing
allocated, so any model size works (`planning.tpu_compiler`); elsewhere, or
with `--compiler=cpu`, XLA:CPU's on as many fake CPU devices as the slice
has, with the model allocated (`planning.compiled_step`). Several slices
joined by the data-center network: `--tpu=2xv5litepod-256` (multislice, v4
and later).

Exit status: 0 when the config fits (with `--auto`: when some layout
does; with the TPU compiler's figures: when they fit), 1 when nothing
fits, so a script can tell; 2 for a mistake in the flags or config.
"""

import json
import sys

from absl import flags, logging
from ml_collections import config_flags

from tpu_keras import cli
from tpu_keras import objectives
from tpu_keras.cluster import engine, topology
from tpu_keras.errors import UserError
from tpu_keras.planning import layout_search, reports, slice_plan

NOTHING_FITS = 1  # the exit status when the config (or, with --auto, every layout) does not fit

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/lm_stdlib.py")
_TPU = flags.DEFINE_string("tpu", None, "The slice to plan for: v4-32, v5litepod-16, v5p-64, v6e-256, "
                          "...; several slices (multislice): 2xv5litepod-256")
_MARGIN = flags.DEFINE_float("margin", 0.1, "Share of HBM kept free for XLA's own buffers, "
                             "padding and fragmentation.")
_MEASURE = flags.DEFINE_bool("measure", False, "Also compile the real training step and print "
                             "the compiler's memory per device, collectives and step-time "
                             "estimate next to the plan: the TPU compiler's for the slice where "
                             "libtpu is installed (nothing allocated), else XLA:CPU's on fake "
                             "CPU devices (the model is allocated).")
_COMPILER = flags.DEFINE_enum("compiler", "auto", ["auto", "tpu", "cpu"], "Which compiler "
                              "--measure asks: tpu (libtpu, the TPU's own), cpu (XLA:CPU on fake "
                              "devices), or auto: tpu where libtpu is installed.")
_AUTO = flags.DEFINE_bool("auto", False, "Try every mesh (data x fsdp x model; a context axis "
                          "too where no whole sequence fits) of the slice with "
                          "each remat setting and recommend the one that fits with the least "
                          "estimated communication time (slices: data across them).")
_COMPILED = flags.DEFINE_integer("compiled", 3, "With --auto --measure on the TPU compiler: how "
                                 "many of the best-planned layouts it compiles; its figures "
                                 "choose among them.", lower_bound=1)
_JSON = flags.DEFINE_bool("json", False, "Print the plan as JSON.")


def main(argv):
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {argv[1:]}")
    if _CONFIG.value is None or not _TPU.value:
        raise UserError("give --config=configs/<name>.py and --tpu=<slice>, e.g. --tpu=v5p-64")
    logging.set_verbosity(logging.WARNING)  # JAX's platform probing is not news here
    objectives.check(_CONFIG.value)  # what train checks first, in the same lines
    compiler = slice_plan.resolve_compiler(_COMPILER.value) if _MEASURE.value else "cpu"
    if _MEASURE.value and compiler == "tpu":  # the slice's own devices, described by libtpu
        engine.select("jax")
    elif _MEASURE.value:  # the real step, on as many fake CPU devices as the slices have
        slices, found = topology.parse_tpu(_TPU.value)
        engine.select("jax", slices * found.devices)
    if not _AUTO.value:
        result = slice_plan.plan(_CONFIG.value, _TPU.value, _MARGIN.value, _MEASURE.value,
                                  compiler)
        print(json.dumps(result, indent=1) if _JSON.value else reports.format_plan(result))
        fits = result["fits"]
    else:
        result = layout_search.search(_CONFIG.value, _TPU.value, _MARGIN.value, _MEASURE.value,
                                      compiler, _COMPILED.value)
        print(json.dumps(result, indent=1) if _JSON.value else reports.format_search(result))
        fits = result["recommended"] is not None and result.get("measured", {}).get("fits", True)
    if not fits:
        sys.stdout.flush()
        sys.exit(NOTHING_FITS)


if __name__ == "__main__":
    cli.start(main)
