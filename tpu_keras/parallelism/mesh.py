"""The device mesh: `config.mesh = {'slices': S, 'data': -1, 'fsdp': F, 'expert': E,
'context': C, 'model': M}` resolved against devices.

Five named axes inside a slice. `data`, `fsdp` and `expert` all split the
batch; `fsdp` also splits every large weight (and its gradient and optimizer
state), which each layer all-gathers when it runs (fully-sharded data
parallelism); `expert` also splits a mixture-of-experts layer's experts
(expert parallelism, as MaxText does: outside those layers it is one more
batch split; inside, each device holds E / expert of the experts and the
tokens are exchanged along it, `models.moe`), by the family's layout rules;
`context` splits each sequence (context parallelism: every activation holds
its share of the tokens, and attention gathers the keys and values along it,
`models.context_attention`); `model` splits weights by the builder's layout
rules (tensor parallelism, see `parallelism.rules`). `context` and `model`
are the last axes, so that JAX lays them on neighbouring chips. -1 means
"all the devices the other axes leave". On the tf engine `fsdp`, `expert`,
`context` and `model` must be 1: Keras 3's TensorFlow backend ignores
layouts (keras-team/keras#18473).

`slices` (default 1) is data parallelism across TPU slices, which only the
data-center network (DCN) joins, far slower than the chip interconnect
inside a slice. So slices carry whole replicas of the weights and exchange
only the gradients' all-reduce: `data`, `fsdp`, `expert` and `model` are
each slice's shape, there are `slices x data x fsdp x expert x context x
model` devices, and the device mesh Keras sees keeps the five axes of `AXES`,
slices folded into the outer part of `data` (`device_grid`). A layout rule
may not name `slices`, nor `data` when it spans slices.
"""

# Imported inside functions: JAX (optional: absent on a plain install; the tf engine runs
# without JAX); NumPy (start-up time: not every caller needs it).
import math

from tpu_keras.errors import UserError, first_line

# The device mesh's axes, as Keras and JAX name them, outermost first: `context` and `model`
# last, where JAX puts neighbouring chips.
AXES = ("data", "fsdp", "expert", "context", "model")
BATCH_AXES = ("data", "fsdp", "expert")  # the axes the batch is split over (outside the experts)
CONTEXT = "context"  # the axis the sequence is split over
SLICES = "slices"  # data parallelism across slices: folded into the device mesh's `data`
_DEFAULTS = {SLICES: 1, "data": -1, "fsdp": 1, "expert": 1, "context": 1, "model": 1}
_SCHEMA = "{'slices': S, 'data': -1, 'fsdp': F, 'expert': E, 'context': C, 'model': M}"


def check(mesh_config, engine: str = "jax") -> dict[str, int]:
    """The mesh's axis sizes, or a one-line error for sizes that no device count fits (or
    that `engine` cannot run)."""
    given = dict(mesh_config or {})
    unknown = sorted(set(given) - set(_DEFAULTS))
    if unknown:
        raise UserError(f"mesh axis {unknown[0]!r} is not one of {tuple(_DEFAULTS)}; the mesh is "
                        f"{_SCHEMA}")
    mesh = {axis: int(given.get(axis, default)) for axis, default in _DEFAULTS.items()}
    if mesh[SLICES] < 1:
        raise UserError(f"mesh.slices={mesh[SLICES]} is not valid: give the number of TPU slices "
                        "the run spans (1 for one slice)")
    if engine == "tf" and mesh[SLICES] > 1:
        raise UserError(f"mesh.slices={mesh[SLICES]} needs the jax engine (--config.engine=jax): "
                        "TensorFlow's TPUStrategy drives one slice from one client, and "
                        "tf.distribute has no mesh across slices")
    wildcards = [axis for axis, size in mesh.items() if size == -1]
    if len(wildcards) > 1 or any(size == 0 or size < -1 for size in mesh.values()):
        raise UserError(f"mesh={mesh} is not valid: give each axis a positive size, "
                        "or -1 on one axis for the devices left over")
    return mesh


def _sizes_that_fit(inside: dict[str, int], devices: int) -> str:
    """Advice for fixed axis sizes whose product does not divide `devices`: the axis sizes
    nearest to those asked for that do, one axis at a time."""
    fixed = {axis: size for axis, size in inside.items() if size != -1}
    for axis, size in sorted(fixed.items(), key=lambda item: -item[1]):
        others = math.prod(s for a, s in fixed.items() if a != axis)
        fits = [n for n in range(1, devices + 1) if devices % (n * others) == 0]
        if fits:
            nearest = sorted(fits, key=lambda n: (abs(n - size), -n))[:2]
            return (f"use mesh.{axis}=" + " or ".join(map(str, sorted(nearest)))
                    + f" (its sizes that divide {devices} with the other axes)")
    return f"use axis sizes whose product divides {devices}"


def batch_splits(mesh: dict[str, int]) -> int:
    """How many ways the batch is split: slices x data x fsdp x expert."""
    return mesh.get(SLICES, 1) * math.prod(mesh.get(axis, 1) for axis in BATCH_AXES)


def row_devices(mesh: dict[str, int]) -> int:
    """The devices that hold the same examples (one batch row): context x model."""
    return mesh.get(CONTEXT, 1) * mesh.get("model", 1)


def resolve(mesh_config, num_devices: int, engine: str = "jax") -> dict[str, int]:
    """Returns `{'slices': S, 'data': D, 'fsdp': F, 'expert': E, 'context': C, 'model': M}`
    with S x D x F x E x C x M == num_devices (D, F, E, C, M: each slice's shape), or a
    one-line error."""
    mesh = check(mesh_config, engine)
    slices = mesh[SLICES]
    if num_devices % slices:
        raise UserError(f"mesh.slices={slices} does not divide the {num_devices} devices; "
                        f"set mesh.slices to the number of slices the devices are in")
    per_slice = num_devices // slices
    inside = {axis: mesh[axis] for axis in AXES}
    wildcards = [axis for axis, size in inside.items() if size == -1]
    fixed = math.prod(size for size in inside.values() if size != -1)
    where = f"{per_slice} devices per slice" if slices > 1 else f"{num_devices} devices"
    if wildcards:
        if per_slice % fixed:
            raise UserError(f"mesh={mesh} does not fit {where}: {fixed} does not "
                            f"divide {per_slice}; {_sizes_that_fit(inside, per_slice)}")
        mesh[wildcards[0]] = per_slice // fixed
    elif fixed != per_slice:
        raise UserError(f"mesh={mesh} needs {fixed * slices} devices but there are {num_devices}; "
                        "set mesh.data=-1 to use them all")
    for axis in ("model", "fsdp", "expert", CONTEXT):
        if engine == "tf" and mesh[axis] > 1:
            raise UserError(f"mesh.{axis}={mesh[axis]} needs the jax engine (--config.engine=jax): "
                            "Keras 3's TensorFlow backend ignores layouts (keras-team/keras#18473)")
    return mesh


def refit(mesh_config, num_devices: int, batch: int) -> dict[str, int]:
    """A run's mesh fitted to `num_devices` it was not made for (an evaluation job on one host
    of a pod, or on a larger one): one slice; `model`, `expert` and `fsdp` as large as both
    the run's and these devices allow (`expert` and `fsdp` also dividing the global `batch`,
    which they split), so that every layout rule still divides the weights it splits; then
    as much `data` as the devices left and the batch allow; `context` as large as the run's
    and the devices left allow. It may use fewer devices than there are (the first ones)."""
    mesh = check(mesh_config, "jax")
    model = math.gcd(max(mesh["model"], 1), num_devices)
    context = math.gcd(max(mesh[CONTEXT], 1), num_devices // model)
    rest = num_devices // (model * context)
    expert = math.gcd(max(mesh["expert"], 1), rest, batch)
    fsdp = math.gcd(max(mesh["fsdp"], 1), rest // expert, batch // expert)
    data = math.gcd(rest // (expert * fsdp), batch // (expert * fsdp))
    return {SLICES: 1, "data": data, "fsdp": fsdp, "expert": expert, CONTEXT: context, "model": model}


def describe(mesh: dict[str, int]) -> str:
    """'data=4 x model=2', with slices, fsdp, expert and context named only when they split
    something."""
    named = [SLICES] * (mesh.get(SLICES, 1) > 1) + [
        a for a in AXES if a not in ("fsdp", "expert", CONTEXT) or mesh.get(a, 1) > 1]
    return " x ".join(f"{axis}={mesh[axis]}" for axis in named)


def grid_of(devices, mesh: dict[str, int], chips=None):
    """`device_grid` of `mesh` (a resolved mesh: its slices and each slice's sizes of `AXES`;
    an axis it leaves out is 1)."""
    return device_grid(devices, mesh.get(SLICES, 1), *(mesh.get(axis, 1) for axis in AXES),
                       chips=chips)


def device_grid(devices, slices: int, *shape: int, chips=None):
    """The devices as a `(slices * data, fsdp, expert, context, model)` array, where `shape`
    is one slice's `data, fsdp, expert, context, model` (the sizes of `AXES`, in order;
    `grid_of` reads them from a mesh): rows `s * data` to `(s + 1) * data - 1` are slice
    `s`, each slice a `shape` block.

    On a TPU, JAX's own helpers lay each slice out on the chips' physical
    coordinates (`mesh_utils.create_device_mesh`: the last axes, where
    collectives are most frequent, on neighbouring chips) and put slices on the
    outer data axis (`create_hybrid_device_mesh` with a DCN shape of
    `(slices, 1, 1, 1, 1)`). That order interleaves hosts: a host's chips may hold
    rows far apart, which `input_pipelines` and `feed_rows` allow for.
    On a pod the launcher simulates (`launch --tpu`), `chips` is libtpu's
    description of that slice (`cluster.libtpu`): the grid is laid out on it
    the same way, and each CPU device stands for the chip of its host and
    place (`stand_ins`). Elsewhere (CPU, fake devices) the devices, ordered
    by process then id, are cut into `slices` equal blocks: the launcher's
    slice `s` is its hosts `s * hosts_per_slice ...`.
    """
    import numpy as np
    shape = tuple(int(n) for n in shape)
    if len(shape) != len(AXES):
        raise TypeError(f"device_grid takes one slice's sizes of {AXES}, got {shape}")
    on_tpu = getattr(devices[0], "platform", "") == "tpu"
    if on_tpu or chips is not None:
        grid = _torus_grid(devices if on_tpu else chips, slices, shape)
        if on_tpu:
            return grid
        twin = stand_ins(chips, devices)
        return np.vectorize(twin.__getitem__, otypes=[object])(grid)
    ordered = sorted(devices, key=lambda d: (getattr(d, "process_index", 0), d.id))
    grid = np.empty(len(ordered), dtype=object)
    grid[:] = ordered
    return grid.reshape(slices * shape[0], *shape[1:])


def _torus_grid(chips, slices: int, shape):
    """JAX's layout of `shape` (one slice's sizes of `AXES`) on the TPU `chips`, slices on
    the outer data axis.

    Where an axis size is no product of the torus's sides (data=8 x model=2 on
    a 4x4 v5litepod-16), JAX refuses unless it may split a physical side
    between two mesh axes; the toolkit lets it, since the alternative is no run.
    """
    from jax.experimental import mesh_utils
    found = sorted({getattr(d, "slice_index", 0) for d in chips})
    if len(found) != slices:
        raise UserError(f"the TPU devices are in {len(found)} slice(s) but mesh.slices={slices}; "
                        f"set --config.mesh.slices={len(found)}")

    def build(mesh_shape, **options):
        if slices == 1:
            return mesh_utils.create_device_mesh(mesh_shape, devices=chips, **options)
        return mesh_utils.create_hybrid_device_mesh(mesh_shape, (slices,) + (1,) * (len(mesh_shape) - 1),
                                                    devices=chips,
                                                    **options)

    try:
        return build(shape)
    except NotImplementedError:
        pass
    try:
        return build(shape, allow_split_physical_axes=True)
    except (NotImplementedError, ValueError) as error:
        raise UserError(f"mesh {' x '.join(f'{a}={n}' for a, n in zip(AXES, shape))} cannot be laid "
                        f"on this slice's chips ({first_line(error, 160)}); "
                        f"{_nearest_buildable(build, shape)} can") from None


def _nearest_buildable(build, shape) -> str:
    """The mesh of the same devices closest to `shape` (one slice's sizes of `AXES`) that
    `build` lays out, as flags. The expert and context sizes stay as asked: they must divide
    the experts and the sequence."""
    expert, context = shape[AXES.index("expert")], shape[AXES.index(CONTEXT)]
    devices = math.prod(shape) // (expert * context)
    divisors = [n for n in range(1, devices + 1) if devices % n == 0]
    candidates = [(devices // (f * m), f, expert, context, m) for f in divisors for m in divisors
                  if (devices // f) % m == 0]
    def distance(candidate):
        return sum(abs(math.log(a / b)) for a, b in zip(candidate, shape))

    for candidate in sorted(candidates, key=distance):
        try:
            build(candidate, allow_split_physical_axes=True)
        except (NotImplementedError, ValueError):
            continue
        return " ".join(f"--config.mesh.{axis}={size}" for axis, size in zip(AXES, candidate))
    return "mesh.data=-1"


def stand_ins(chips, devices) -> dict:
    """{chip: device}: the k-th device of each process (by id) stands for the k-th chip of
    the same host (by id), as a TPU VM numbers its local devices."""
    def by_host(items):
        hosts = {}
        for item in sorted(items, key=lambda d: d.id):
            hosts.setdefault(getattr(item, "process_index", 0), []).append(item)
        return hosts
    chips_of, devices_of = by_host(chips), by_host(devices)
    shapes = ({h: len(c) for h, c in chips_of.items()}, {h: len(d) for h, d in devices_of.items()})
    if shapes[0] != shapes[1]:
        raise UserError(f"the simulated TPU has {len(chips_of)} host(s) of "
                        f"{max(shapes[0].values())} chips but this run has {len(devices_of)} "
                        f"process(es) with {sorted(set(shapes[1].values()))} devices each; start "
                        "the hosts with `python -m tpu_keras.launch --tpu=...` alone")
    return {chip: device for host, host_chips in chips_of.items()
            for chip, device in zip(host_chips, devices_of[host])}


def slice_of_row(row: int, mesh: dict[str, int]) -> int:
    """The slice that holds row `row` of `device_grid`'s data axis."""
    return row // mesh["data"]


def batch_rows(grid, per_row: int) -> dict[int, tuple[int, ...]]:
    """{process: the batch rows its devices hold}, ascending. A row is one of the batch's
    `data x fsdp x expert` splits (one per row of the grid with those flattened); its
    `per_row` devices (context x model, `row_devices`) hold the same examples."""
    rows = grid.reshape(-1, per_row)
    held = {}
    for index, row in enumerate(rows):
        for device in row:
            held.setdefault(getattr(device, "process_index", 0), set()).add(index)
    return {process: tuple(sorted(found)) for process, found in sorted(held.items())}


def input_pipelines(rows_by_process: dict, process: int) -> tuple[int, int]:
    """How many distinct input pipelines feed the mesh, and which one `process` runs
    (`pipelines`, for one process)."""
    return pipelines(rows_by_process)[process]


def pipelines(rows_by_process: dict) -> dict[int, tuple[int, int]]:
    """{process: (how many distinct input pipelines feed the mesh, the one it runs)}.

    `rows_by_process` is `batch_rows`. Processes that hold the same rows (a
    model axis across hosts) share a pipeline and read the same examples;
    otherwise each process has its own. A process's rows need not be
    neighbours: on a TPU they seldom are, and its pipeline's batch fills them
    in ascending order (`feed_rows`). Pipelines are numbered by their first row.
    """
    groups = sorted(set(rows_by_process.values()), key=lambda rows: rows[0])
    held = [row for rows in groups for row in rows]
    if len(held) != len(set(held)) or len({len(rows) for rows in groups}) != 1:
        first, second = next((a, b) for a in groups for b in groups
                             if a != b and (set(a) & set(b) or len(a) != len(b)))
        owners = [next(p for p, rows in rows_by_process.items() if rows == g)
                  for g in (first, second)]
        raise UserError(f"hosts {owners[0]} and {owners[1]} hold different but overlapping batch "
                        f"rows of the mesh ({list(first)} and {list(second)}), so no one input "
                        "pipeline can feed either; use a mesh.model that divides the devices of a "
                        "host")
    index = {rows: i for i, rows in enumerate(groups)}
    return {process: (len(groups), index[rows]) for process, rows in rows_by_process.items()}


def feed_rows(rows_by_process: dict, global_batch: int) -> dict[int, list[int]]:
    """{process: the global batch's example positions its pipeline's batch fills, in order}.

    `jax.make_array_from_process_local_data` lays a process's batch over the
    rows its devices hold, the lowest row first, `global_batch / rows` examples
    each. So the k-th example a host reads lands at this list's k-th position.
    """
    per_row = global_batch // (1 + max(row for rows in rows_by_process.values() for row in rows))
    return {process: [row * per_row + i for row in rows for i in range(per_row)]
            for process, rows in rows_by_process.items()}
