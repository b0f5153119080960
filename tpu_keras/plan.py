"""Will this config fit that TPU slice? Memory per device, before you pay for the slice.

    python -m tpu_keras.plan --config=configs/lm_stdlib.py --tpu=v5p-64 [--json]
    python -m tpu_keras.plan --config=configs/lm_stdlib.py --tpu=v4-32 \\
        --config.engine=jax --config.mesh.model=2 --config.train.batch_size=1024

Per device of the slice, on the config's mesh:
- parameters and optimizer state: exact, the layout tool's arithmetic
  (`python -m tpu_keras.layout`) on the slice's device count;
- gradients: one per trainable weight, laid out like it (exact);
- activations: an estimate with rematerialisation off, the tensors autodiff
  keeps for the backward pass at the per-replica batch (`tpu_keras.memory`).
  With mesh.model > 1 they are counted whole on every device, an upper bound.

Then whether the sum fits the device's HBM less `--margin` (room for XLA's
own buffers and fragmentation), and the largest global batch that would.
`--measure` compiles the gradient on this machine's first device and prints
XLA's activation bytes next to the estimate; on a TPU VM that is the TPU
compiler's own figure. Nothing is allocated; it needs the jax extra.
"""

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from tpu_keras.errors import UserError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/lm_stdlib.py")
_TPU = flags.DEFINE_string("tpu", None, "The slice to plan for: v4-32, v5litepod-16, v5p-64, v6e-256, ...")
_MARGIN = flags.DEFINE_float("margin", 0.1, "Share of HBM kept free for XLA's own buffers, "
                             "padding and fragmentation.")
_MEASURE = flags.DEFINE_bool("measure", False, "Also compile the gradient here and report "
                             "XLA's activation bytes next to the estimate.")
_JSON = flags.DEFINE_bool("json", False, "Print the plan as JSON.")


def plan(config, slice_name: str, margin: float = 0.1, measure: bool = False) -> dict:
    """The memory plan of `config` on the slice `slice_name` (a dict, JSON-ready)."""
    from tpu_keras import engine, topology
    from tpu_keras import mesh as mesh_lib
    found = topology.parse_slice(slice_name)
    if not 0 <= margin < 1:
        raise UserError(f"--margin={margin} must be at least 0 and below 1, e.g. 0.1 for 10%")
    mesh = mesh_lib.resolve(config.mesh, found.devices, config.engine)
    global_batch = config.train.batch_size
    if global_batch % mesh["data"]:
        raise UserError(f"train.batch_size={global_batch} does not divide over the {mesh['data']} "
                        f"data replicas of {found.name}; use a multiple of {mesh['data']}")
    per_replica = global_batch // mesh["data"]

    engine.select("jax")  # the allocation-free build, whatever engine trains
    import keras
    from keras.src.backend.common.stateless_scope import StatelessScope
    from tpu_keras import memory, models
    from tpu_keras.layout import report
    # A TPU run's default: bf16 activations (tpu_keras.performance).
    precision = "mixed_bfloat16" if config.train.precision == "auto" else config.train.precision
    keras.config.set_dtype_policy(precision)
    layout = report.describe(config, found.devices)
    builder, kwargs = models.registry.get(config.model)
    with StatelessScope(initialize_variables=False):
        model = builder.make(**kwargs)
        activations = memory.activation_bytes(model, builder.loss(), per_replica)
        # Linear in the batch, plus what does not grow with it (masks, positions).
        per_example = (memory.activation_bytes(model, builder.loss(), 2 * per_replica)
                       - activations) / per_replica
        constant = activations - per_example * per_replica
        measured = (memory.measured_activation_bytes(model, builder.loss(), per_replica)
                    if measure else None)

    totals = layout["totals"]
    per_device = {"parameters": totals["parameters"]["bytes_per_device"],
                  "optimizer": totals["optimizer"]["bytes_per_device"],
                  "gradients": totals["gradients"]["bytes_per_device"],
                  "activations": activations}
    fixed = (per_device["parameters"] + per_device["optimizer"] + per_device["gradients"]
             + constant)
    per_device["total"] = round(fixed + per_example * per_replica)
    usable = int(found.hbm_bytes_per_device * (1 - margin))
    largest = int((usable - fixed) // per_example) * mesh["data"] if usable > fixed else 0
    result = {
        "model": config.model.name, "slice": found.name, "generation": found.generation.name,
        "hosts": found.hosts, "devices": found.devices, "mesh": mesh,
        "hbm_bytes_per_device": found.hbm_bytes_per_device, "margin": margin,
        "usable_bytes_per_device": usable, "precision": precision,
        "global_batch": global_batch, "per_replica_batch": per_replica,
        "per_device": per_device,
        "activations_upper_bound": mesh["model"] > 1,
        "fits": per_device["total"] <= usable,
        "largest_global_batch": largest,
    }
    if measured is not None:
        import jax
        result["measured_activations"] = {"bytes": int(measured), "backend": jax.default_backend()}
    return result


def format_plan(p: dict) -> str:
    from tpu_keras.layout.report import format_bytes
    mesh, d = p["mesh"], p["per_device"]
    note = {"parameters": "exact (the layout tool's arithmetic)", "optimizer": "exact",
            "gradients": "exact",
            "activations": "estimate: what the backward pass keeps, no rematerialisation"
                           + (" (upper bound: counted whole on each model-axis device)"
                              if p["activations_upper_bound"] else "")}
    lines = [f"{p['model']} on {p['slice']}: {p['devices']} devices on {p['hosts']} host(s), "
             f"{format_bytes(p['hbm_bytes_per_device'])} HBM per device",
             f"mesh data={mesh['data']} x model={mesh['model']}, global batch "
             f"{p['global_batch']:,} ({p['per_replica_batch']:,} per replica), {p['precision']}", "",
             "per device"]
    labels = {"parameters": "parameters", "optimizer": "optimizer state",
              "gradients": "gradients", "activations": "activations"}
    for key, label in labels.items():
        lines.append(f"  {label:<16} {format_bytes(d[key]):>11}  {note[key]}")
    lines.append(f"  {'total':<16} {format_bytes(d['total']):>11}")
    if "measured_activations" in p:
        measured = p["measured_activations"]
        ratio = d["activations"] / measured["bytes"] if measured["bytes"] else float("inf")
        lines.append(f"  {'measured':<16} {format_bytes(measured['bytes']):>11}  activations by XLA on "
                     f"{measured['backend']} (estimate / measured = {ratio:.2f})")
    lines += ["", f"usable HBM: {format_bytes(p['usable_bytes_per_device'])} per device "
                  f"({p['margin']:.0%} kept free)"]
    share = d["total"] / p["usable_bytes_per_device"]
    if p["fits"]:
        lines.append(f"fits: yes, {share:.1%} of usable HBM" if share >= 0.001
                     else "fits: yes, under 0.1% of usable HBM")
    else:
        lines.append(f"fits: NO, {share:.0%} of usable HBM: lower train.batch_size, split the "
                     "weights over mesh.model (jax engine) or use a larger slice")
    if p["largest_global_batch"]:
        lines.append(f"largest global batch that fits: {p['largest_global_batch']:,} "
                     f"({p['largest_global_batch'] // mesh['data']:,} per replica)")
    else:
        lines.append("largest global batch that fits: none (the weights, optimizer state and "
                     "gradients alone fill HBM)")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}")
    if _CONFIG.value is None or not _TPU.value:
        sys.exit("error: give --config=configs/<name>.py and --tpu=<slice>, e.g. --tpu=v5p-64")
    logging.set_verbosity(logging.WARNING)  # JAX's platform probing is not news here
    try:
        from tpu_keras import config as config_lib
        config_lib.check(_CONFIG.value)
        result = plan(_CONFIG.value, _TPU.value, _MARGIN.value, _MEASURE.value)
    except UserError as error:
        sys.exit(f"error: {error}")
    print(json.dumps(result, indent=1) if _JSON.value else format_plan(result))


if __name__ == "__main__":
    app.run(main)
