"""Every mesh `plan --auto` can recommend, on every TPU type of 1 to 64 hosts, laid out on
libtpu's description of the slice as a run lays it out on a TPU.

    python tests/helpers/topology_matrix.py [TYPE ...]

Types: every v4, v5e, v5p and v6e slice of the topology table with 1 to 64
hosts, each as 1, 2 and 4 slices (or the TYPEs given, such as 2xv4-16). For
each, every (data, fsdp, expert=1, model) of one slice's devices (`layout_search.meshes`)
goes through `mesh.device_grid` on the slice's libtpu devices, then each host
gets its input pipeline (`mesh.pipelines`), and one global batch is fed
as the hosts feed it: each pipeline reads its own share of the examples and
its hosts' batches land where `mesh.feed_rows` says. Each type prints one
`MATRIX {json}` line: meshes checked, those whose hosts hold rows that are
not one aligned block (which the toolkit refused before it followed the
TPU's chip order), and every failure (a refusal or an example lost or fed
twice) with its reason.
"""

import collections
import json
import sys

import numpy as np

from tpu_keras.cluster import libtpu, topology
from tpu_keras.errors import UserError
from tpu_keras.parallelism import mesh as mesh_lib
from tpu_keras.planning.layout_search import meshes

GENERATIONS = ("v4", "v5e", "v5p", "v6e")
SLICE_COUNTS = (1, 2, 4)
MAX_HOSTS = 64
EXAMPLES_PER_ROW = 2


def slice_types():
    """Every slice type of the four generations with 1 to MAX_HOSTS hosts."""
    for name in GENERATIONS:
        gen = topology.GENERATIONS[name]
        unit = gen.name_units_per_chip
        numbers = gen.sizes or range(unit, gen.max_slice_chips * unit + 1, unit)
        for number in numbers:
            try:
                found = topology.parse_slice(f"{gen.prefix}-{number}")
            except UserError:
                continue  # not a slice size of this generation
            if found.hosts <= MAX_HOSTS:
                yield found.name


def check(chips, slices: int, mesh: tuple) -> tuple[str, bool]:
    """('' or why it fails, whether some host's rows are not one aligned block); `mesh` is
    one slice's sizes of `mesh_lib.AXES`."""
    grid = mesh_lib.device_grid(chips, slices, *mesh)
    if grid.shape != (slices * mesh[0], *mesh[1:]) or len({d.id for d in grid.flat}) != len(chips):
        return f"grid {grid.shape} does not hold every chip once", False
    rows = mesh_lib.batch_rows(grid, mesh[-2] * mesh[-1])  # context x model
    pipelines = mesh_lib.pipelines(rows)
    count = {n for n, _ in pipelines.values()}
    if len(count) != 1:
        return f"hosts disagree on the number of pipelines: {count}", False
    row_count = slices * int(np.prod(mesh[:-2]))  # data x fsdp x expert
    global_batch = row_count * EXAMPLES_PER_ROW
    per_host = global_batch // count.pop()
    positions = mesh_lib.feed_rows(rows, global_batch)
    batch = np.full(global_batch, -1)
    for process, (_, index) in pipelines.items():
        examples = np.arange(index * per_host, (index + 1) * per_host)  # the pipeline's share
        if len(positions[process]) != per_host:
            return f"host {process} fills {len(positions[process])} rows of a {per_host}-example batch", False
        filled = batch[positions[process]]
        if np.any((filled != -1) & (filled != examples)):
            return f"host {process} feeds rows another host fed with other examples", False
        batch[positions[process]] = examples
    if sorted(batch.tolist()) != list(range(global_batch)):
        return "the global batch does not hold every example exactly once", False
    aligned = all(r == tuple(range(r[0], r[0] + len(r))) and r[0] % len(r) == 0 for r in rows.values())
    return "", not aligned


def main(types):
    for name in types:
        slice_counts = SLICE_COUNTS if "x" not in name else (None,)
        for slices in slice_counts:
            tpu_type = name if slices is None else (f"{slices}x{name}" if slices > 1 else name)
            count, found = topology.parse_tpu(tpu_type)
            chips = libtpu.devices(tpu_type)
            report = collections.Counter()
            failures = []
            for mesh in meshes(found.devices):
                shape = tuple(mesh[axis] for axis in mesh_lib.AXES)
                try:
                    why, interleaved = check(chips, count, shape)
                except UserError as error:
                    why, interleaved = f"refused: {error}", False
                report["meshes"] += 1
                report["interleaved"] += interleaved
                if why:
                    failures.append({"mesh": shape, "why": why})
            print("MATRIX " + json.dumps({
                "tpu": tpu_type, "topology": found.topology_name, "slices": count,
                "hosts": count * found.hosts, "devices": len(chips), **report,
                "failures": failures}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(slice_types()))
