"""Where every weight of a config's model lives, and what each device holds.

`layout_of()` builds the model and its optimizer inside a Keras
`StatelessScope` on the jax backend (the tf backend cannot build an
optimizer there), so it reads paths and shapes without allocating a weight,
and places them by the same `Placer` the engines use. The arithmetic is
exact: every sharded dimension divides its mesh axis, so every device holds
the same bytes. `python -m tpu_keras.layout` prints it; the memory plan
(`python -m tpu_keras.plan`) builds on these figures.
"""

# Imported inside functions: Keras (the engine must be selected first: engine.select); NumPy
# (start-up time: not every caller needs it).
import math

from tpu_keras.parallelism import mesh as mesh_lib
from tpu_keras.parallelism.rules import Placement, dtype_name


def layout_of(config, num_devices: int) -> dict:
    """Returns the layout report of `config`'s model on `num_devices` devices (a dict, JSON-ready)."""
    mesh = mesh_lib.resolve(config.mesh, num_devices, "jax")
    return report_on(config, mesh, *abstract_model(config))


def abstract_model(config):
    """The config's model and its built optimizer: paths, shapes and dtypes, no memory behind them."""
    import keras
    from tpu_keras import models
    from tpu_keras.training import optimization

    builder, kwargs = models.registry.get(config.model)
    optimizer = optimization.make_optimizer(config.train)
    with keras.StatelessScope(initialize_variables=False):  # deferred variables
        model = builder.make(**kwargs)
        optimizer.build(model.trainable_variables)
    return model, optimizer


def placements(config, mesh: dict, model) -> list[Placement]:
    """Where each of `model`'s weights lives on `mesh`, by the config's rules (checked)."""
    from tpu_keras import models
    return models.registry.placer(config.model, config.layout, mesh).check(model.weights)


def report_on(config, mesh: dict, model, optimizer) -> dict:
    """The layout report of an `abstract_model` on a resolved `mesh`."""
    weights = placements(config, mesh, model)
    trainable = {v.path for v in model.trainable_variables}
    by_path = {p.path: p for p in weights}
    state = [_follow(v, by_path) for v in optimizer.variables]
    return {
        "model": config.model.name,
        "engine": config.engine,
        "mesh": mesh,
        "devices": math.prod(mesh.values()),
        "weights": [_row(p, mesh) for p in weights],
        "optimizer": [_row(p, mesh) for p in state],
        "totals": {"parameters": _totals(weights, mesh), "optimizer": _totals(state, mesh),
                   # One gradient per trainable weight, laid out (and typed) like it.
                   "gradients": _totals([p for p in weights if p.path in trainable], mesh)},
    }


def format_table(report: dict) -> str:
    """The report as a table: one row per weight, then the totals per device."""
    mesh = report["mesh"]
    rows = [(w["path"], "x".join(map(str, w["shape"])) or "scalar", w["layout"], format_bytes(w["bytes_per_device"]))
            for w in report["weights"]]
    widths = [max(len(r[i]) for r in rows + [("weight", "shape", "layout", "per device")]) for i in range(4)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [f"{report['model']} on a {mesh_lib.describe(mesh)} mesh ({report['devices']} devices)",
           "", line(("weight", "shape", "layout", "per device"))]
    out += [line(r) + (f"  {w['note']}" if w.get("note") else "") for r, w in zip(rows, report["weights"])]
    out.append("")
    for name, label in (("parameters", "parameters"), ("optimizer", "optimizer state")):
        t = report["totals"][name]
        out.append(f"{label:<16} {t['count']:>14,} values  {format_bytes(t['bytes']):>11} in all  "
                   f"{format_bytes(t['bytes_per_device']):>11} per device")
    return "\n".join(out)


def _follow(variable, by_path) -> Placement:
    """An optimizer variable, placed like the weight it belongs to (Keras gives it that layout).

    Keras names slots `<optimizer>/<weight path with _ for />_<slot>`;
    scalars such as the step count match no weight and are replicated.
    """
    name = variable.path.split("/", 1)[-1]
    owners = [p for p in by_path if name.startswith(p.replace("/", "_") + "_")]
    shape = tuple(variable.shape)
    if owners:
        owner = by_path[max(owners, key=len)]
        if owner.shape == shape:
            return Placement(variable.path, shape, dtype_name(variable.dtype), owner.axes, owner.rule,
                             owner.note)
    return Placement(variable.path, shape, dtype_name(variable.dtype), (None,) * len(shape), None)


def _row(p: Placement, mesh) -> dict:
    return {"path": p.path, "shape": list(p.shape), "dtype": p.dtype, "layout": p.spec,
            "rule": p.rule, "note": p.note, "shard_shape": list(p.shard_shape(mesh)),
            "bytes_per_device": p.bytes_per_device(mesh)}


def _totals(placements, mesh) -> dict:
    return {"count": sum(math.prod(p.shape) for p in placements),
            "bytes": sum(p.nbytes for p in placements),
            "bytes_per_device": sum(p.bytes_per_device(mesh) for p in placements)}


def format_bytes(num_bytes: float) -> str:
    """1.83 MiB, 939.00 KiB, 512 B: sizes as the layout tool and the planner print them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
