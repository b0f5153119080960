"""Which network a collective's bytes cross, and how long they take: inside a slice or across slices.

Chips of one TPU slice talk over the chip interconnect (ICI); slices of a
multislice job talk through their hosts over the data-center network (DCN),
far slower per chip. XLA generates the cross-slice code itself
(https://cloud.google.com/tpu/docs/multislice-introduction) and runs a
collective over devices in several slices hierarchically: inside each
slice over ICI, and only what is left across slices over DCN. For a
collective over `k` devices in each of `S` slices (`n = k S`) on a result
of `B` bytes, each device sends across slices:

- all-reduce: reduce-scatter inside the slice, all-reduce of its `B/k`
  shard across slices, all-gather inside: `2 (S-1)/S B/k`;
- all-gather: the `B/n` pieces gathered across slices first: `(S-1)/S B/k`;
- reduce-scatter (`B` the shard): the reverse, `(S-1) B`;

and the rest of the flat ring's bytes inside the slice (the sums equal the
flat ring's). The time is an ideal's: bytes over the published bandwidth
(`cluster.topology.NETWORKS`), ICI at half its bidirectional figure (what
leaves a chip), DCN at the host network's share per chip; no latency, no
overlap with compute, and the two networks one after the other.

That ideal assumes each device's ring neighbour is a neighbouring chip.
`ring_hops` measures how far apart they are in a real layout (libtpu's chip
coordinates): a ring step that crosses two links shares them with another
step, so a layout's ICI time is at least its bytes' ideal time times the
hops of the axis they cross.
"""

# Imported inside functions: NumPy (start-up time: not every caller needs it).
import math


def ring(n: int) -> float:
    """The share of a tensor each of `n` devices sends in an all-gather or a reduce-scatter."""
    return (n - 1) / n if n > 1 else 0.0


def hierarchical(op: str, nbytes: float, inside: int, slices: int) -> tuple[float, float]:
    """(inside-slice, across-slice) bytes one device sends for `op` ('all-reduce',
    'all-gather', 'reduce-scatter') on a `nbytes` result over `inside` devices in
    each of `slices` slices."""
    n = inside * slices
    if op == "all-reduce":
        total, across = 2 * ring(n) * nbytes, 2 * ring(slices) * nbytes / inside
    elif op == "all-gather":
        total, across = ring(n) * nbytes, ring(slices) * nbytes / inside
    elif op == "reduce-scatter":
        total, across = (n - 1) * nbytes, (slices - 1) * nbytes
    else:  # all-to-all, collective-permute: what goes to another slice, roughly all of it
        across = nbytes if slices > 1 else 0.0
        return nbytes - across, across
    return total - across, across


def across_slices(sent: dict) -> int:
    """The bytes of a `sent` dict (by collective) that cross between slices."""
    return sum(value for key, value in sent.items() if key.endswith("_across_slices"))


def estimate(sent: dict, generation, slices: int) -> dict:
    """Bytes inside and across slices, and their estimated seconds per update (None where
    the generation has no published figure)."""
    across = across_slices(sent)
    inside = sent["total"] - across
    per_chip = generation.devices_per_chip  # devices of a chip share its links
    ici, dcn = generation.ici_gbps_per_chip, generation.dcn_gbps_per_chip
    ici_s = inside * per_chip / (ici / 2 * 1e9 / 8) if ici else None
    dcn_s = (across * per_chip / (dcn * 1e9 / 8) if dcn else None) if across else 0.0
    return {"inside_slice": inside, "across_slices": across, "slices": slices,
            "ici_seconds": ici_s, "dcn_seconds": dcn_s,
            "seconds": None if ici_s is None or dcn_s is None else ici_s + dcn_s}


def ring_hops(grid, axes, sides, wraps) -> float:
    """The mean number of chip-to-chip links between ring neighbours along the mesh `axes`
    (indices into `grid`'s shape, taken together in order) of a grid of TPU devices.

    `sides` and `wraps` are the slice's chip shape and which of its sides close
    into a ring (`cluster.topology.Slice`). 1.0 is the ideal (every neighbour
    one link away, the last back to the first included); 0.0 for an axis of
    size 1. Devices of one chip (v2, v3) are 0 links apart.
    """
    import numpy as np  # only the planner's callers measure layouts
    size = math.prod(grid.shape[a] for a in axes)
    if size == 1:
        return 0.0
    rings = np.moveaxis(grid, list(axes), list(range(-len(axes), 0))).reshape(-1, size)

    def links(a, b):
        steps = [abs(x - y) for x, y in zip(a.coords, b.coords)]
        return sum(min(step, side - step) if wrap else step
                   for step, side, wrap in zip(steps, sides, wraps))

    total = sum(links(ring[i], ring[(i + 1) % size]) for ring in rings for i in range(size))
    return total / rings.size
