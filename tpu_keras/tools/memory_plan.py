"""Will this config fit that TPU slice? Memory per device, before you pay for the slice.

The arithmetic behind `python -m tpu_keras.plan`. Per device of the slice,
on the config's mesh:
- parameters and optimizer state: exact, the layout report's arithmetic
  (`layout_report`) on the slice's device count;
- gradients: one per trainable weight, laid out like it (exact);
- activations: an estimate with rematerialisation off, the tensors autodiff
  keeps for the backward pass at the per-replica batch (`measurement.memory`).
  With mesh.model > 1 they are counted whole on every device, an upper bound.

Then whether the sum fits the device's HBM less a margin (room for XLA's
own buffers and fragmentation), and the largest global batch that would.
Nothing is allocated; it needs the jax extra.
"""

from tpu_keras.cluster import engine, topology
from tpu_keras.errors import UserError
from tpu_keras.parallelism import mesh as mesh_lib
from tpu_keras.tools import layout_report
from tpu_keras.tools.layout_report import format_bytes


def plan(config, slice_name: str, margin: float = 0.1, measure: bool = False) -> dict:
    """The memory plan of `config` on the slice `slice_name` (a dict, JSON-ready)."""
    found = topology.parse_slice(slice_name)
    if not 0 <= margin < 1:
        raise UserError(f"--margin={margin} must be at least 0 and below 1, e.g. 0.1 for 10%")
    mesh = mesh_lib.resolve(config.mesh, found.devices, config.engine)
    global_batch = config.train.batch_size
    splits = mesh_lib.batch_splits(mesh)
    if global_batch % splits:
        raise UserError(f"train.batch_size={global_batch} does not divide over the {splits} "
                        f"batch splits (data x fsdp) of {found.name}; use a multiple of {splits}")
    per_replica = global_batch // splits

    engine.select("jax")  # the allocation-free build, whatever engine trains
    import keras
    from tpu_keras import models
    from tpu_keras.measurement import memory
    # A TPU run's default: bf16 activations (tpu_keras.training.defaults).
    precision = "mixed_bfloat16" if config.train.precision == "auto" else config.train.precision
    keras.config.set_dtype_policy(precision)
    layout = layout_report.describe(config, found.devices)
    builder, kwargs = models.registry.get(config.model)
    with keras.StatelessScope(initialize_variables=False), models.registry.remat_scope(config.train.remat):
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
    largest = int((usable - fixed) // per_example) * splits if usable > fixed else 0
    result = {
        "model": config.model.name, "slice": found.name, "generation": found.generation.name,
        "hosts": found.hosts, "devices": found.devices, "mesh": mesh,
        "hbm_bytes_per_device": found.hbm_bytes_per_device, "margin": margin,
        "usable_bytes_per_device": usable, "precision": precision, "remat": config.train.remat,
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
    """The plan as the command prints it: bytes per device, whether it fits, the largest batch."""
    mesh, d = p["mesh"], p["per_device"]
    note = {"parameters": "exact (the layout tool's arithmetic)", "optimizer": "exact",
            "gradients": "exact",
            "activations": "estimate: what the backward pass keeps"
                           + (f", remat {p['remat']}" if p.get("remat", "none") != "none"
                              else ", no rematerialisation")
                           + (" (upper bound: counted whole on each model-axis device)"
                              if p["activations_upper_bound"] else "")}
    lines = [f"{p['model']} on {p['slice']}: {p['devices']} devices on {p['hosts']} host(s), "
             f"{format_bytes(p['hbm_bytes_per_device'])} HBM per device",
             f"mesh {mesh_lib.describe(mesh)}, global batch "
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
                     f"({p['largest_global_batch'] // mesh_lib.batch_splits(mesh):,} per replica)")
    else:
        lines.append("largest global batch that fits: none (the weights, optimizer state and "
                     "gradients alone fill HBM)")
    return "\n".join(lines)
