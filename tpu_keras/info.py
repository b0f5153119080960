"""Print what `connect()` finds on this machine: the first command to run on a new cluster.

    python -m tpu_keras.info [--json]
    python -m tpu_keras.info --config=configs/lm_stdlib.py --config.cluster.tpu=local
    python -m tpu_keras.launch --hosts=2 --devices_per_host=2 -- python -m tpu_keras.info --json
    python -m tpu_keras.info --tpu=v5litepod-16 --config=configs/lm_stdlib.py --config.mesh.model=2

Shows the strategy (or jax mesh) a run would get, hosts and this host's
index, replicas, devices, the TPU slice and its published figures, and the
peak FLOP/s that MFU divides by (`tools.cluster_info`). On a machine without
a TPU it shows the fallback a run would use. With --json each host prints
one line of JSON.

With --tpu it connects to nothing: it shows how the config's mesh lies on
that slice, host by host, as the TPU runtime describes the slice
(`tools.slice_layout`; it needs libtpu, the tpu extra, but no TPU).
"""

import json

from absl import flags, logging
from ml_collections import config_flags

from tpu_keras import cli, cluster as cluster_lib
from tpu_keras import config as config_lib, objectives
from tpu_keras.cluster import engine
from tpu_keras.errors import UserError
from tpu_keras.tools import cluster_info, slice_layout
from tpu_keras.training import auto_values

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config whose `cluster` and `mesh` sections to connect with (default: "
    "tpu_keras.config.defaults()).")
_ENGINE = flags.DEFINE_enum("engine", None, ["tf", "jax"], "Overrides the config's engine.")
_JSON = flags.DEFINE_bool("json", False, "Print one line of JSON instead of a table.")
_TPU = flags.DEFINE_string("tpu", "", "A TPU type ('v5litepod-16', '2xv4-16'): show how the "
                           "config's mesh lies on it, host by host, instead of connecting.")


def main(argv):
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value if _CONFIG.value is not None else config_lib.defaults()
    if _ENGINE.value:
        config.engine = _ENGINE.value
    objectives.check(config)
    if _TPU.value:
        layout = slice_layout.layout_on_slice(config, _TPU.value)
        print(json.dumps(layout) if _JSON.value else slice_layout.format_layout(layout), flush=True)
        return
    engine.select(config.engine, config.cluster.virtual_devices)
    cluster = cluster_lib.connect(config.cluster, engine=config.engine, mesh=config.mesh)
    info = cluster_info.facts(cluster, auto_values.precision(config.train, cluster.kind))
    print(json.dumps(info) if _JSON.value else cluster_info.format_table(info), flush=True)


if __name__ == "__main__":
    cli.start(main)
