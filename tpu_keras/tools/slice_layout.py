"""`python -m tpu_keras.info --tpu=TYPE`: how a run's mesh lies on a TPU slice, read from
libtpu without the slice (`cluster.libtpu`).

The jax engine lays the mesh out as `parallelism.mesh.device_grid` does on
that slice's chips. For each host: its chips' coordinates, the batch rows
they hold (on a TPU seldom neighbours), and the input pipeline that feeds
them; per mesh axis, how many chip-to-chip links separate ring neighbours
(`planning.network.ring_hops`; 1.0 is the ideal the planner's time
assumes). On the tf engine `TPUStrategy` numbers its replicas host by host
and each host feeds its own, so only that is shown.
"""

from tpu_keras.cluster import libtpu
from tpu_keras.planning import network
from tpu_keras.parallelism import mesh as mesh_lib
from tpu_keras.planning import slice_plan


def layout_on_slice(config, tpu_type: str) -> dict:
    """The layout of `config`'s mesh on `tpu_type`, JSON-ready."""
    slices, found = slice_plan.tpu_slices(config, tpu_type)  # the config's slices agree
    chips = libtpu.devices(tpu_type)
    mesh = mesh_lib.resolve({**dict(config.mesh), mesh_lib.SLICES: slices}, len(chips),
                            config.engine)
    result = {"tpu": tpu_type, "topology": found.topology_name, "slices": slices,
              "hosts": slices * found.hosts, "devices": len(chips), "engine": config.engine,
              "mesh": mesh}
    chips_of = {}
    for chip in sorted(chips, key=lambda c: c.id):
        chips_of.setdefault(chip.process_index, []).append(list(chip.coords))
    if config.engine == "tf":  # TPUStrategy: replicas host by host, each host feeding its own
        per_host = len(chips) // result["hosts"]
        result["by_host"] = [{"host": h, "chips": chips_of[h],
                              "replicas": list(range(h * per_host, (h + 1) * per_host))}
                             for h in sorted(chips_of)]
        return result
    grid = mesh_lib.grid_of(chips, {**mesh, mesh_lib.SLICES: slices})
    rows = mesh_lib.batch_rows(grid, mesh_lib.row_devices(mesh))
    pipeline_of = mesh_lib.pipelines(rows)
    one_slice = grid[:mesh["data"]]  # ring hops inside a slice; slices meet over the DCN
    result["by_host"] = [{"host": h, "chips": chips_of[h], "batch_rows": list(rows[h]),
                          "input_pipeline": pipeline_of[h]}
                         for h in sorted(rows)]
    along = {axis: (i,) for i, axis in enumerate(mesh_lib.AXES)}
    along["batch"] = tuple(mesh_lib.AXES.index(axis) for axis in mesh_lib.BATCH_AXES)
    result["ring_hops"] = {
        name: round(network.ring_hops(one_slice, axes, found.chip_shape, found.wraparound), 3)
        for name, axes in along.items()}
    return result


def format_layout(info: dict) -> str:
    """The layout as `info --tpu` prints it: a few lines, then one per host."""
    hosts = info["hosts"]
    lines = [f"TPU slice   {info['tpu']} ({info['topology']} as libtpu describes it): "
             f"{hosts} host(s), {info['devices']} devices",
             f"mesh        {mesh_lib.describe(info['mesh'])} ({info['engine']} engine)"]
    for host in info["by_host"]:
        chips = " ".join("(" + ",".join(map(str, c)) + ")" for c in host["chips"])
        if "replicas" in host:
            held = f"replicas {_span(host['replicas'])}"
        else:
            count, index = host["input_pipeline"]
            held = (f"batch rows {', '.join(map(str, host['batch_rows']))} "
                    f"(input pipeline {index} of {count})")
        lines.append(f"host {host['host']:<6} chips {chips}  {held}")
    if "ring_hops" in info:
        hops = ", ".join(f"{axis} {value:.2f}" for axis, value in info["ring_hops"].items()
                         if value and (axis != "batch" or _batch_beyond_data(info["mesh"])))
        lines.append(f"ring hops   {hops or 'none (one device)'} "
                     "(links between ring neighbours along each axis; 1.00 = neighbouring chips)")
    else:
        lines.append("TPUStrategy numbers replicas host by host; each host feeds its own replicas")
    return "\n".join(lines)


def _batch_beyond_data(mesh: dict) -> bool:
    """Whether the batch is split over more than `data`, so its ring is not data's."""
    return any(mesh.get(axis, 1) > 1 for axis in mesh_lib.BATCH_AXES if axis != "data")


def _span(values) -> str:
    return f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0])
