"""Bytes each device sends in a compiled program's collectives, read from its HLO text.

The check on `measurement.communication`: XLA's SPMD partitioner decides
which collectives a sharded step really runs, and it may add some the
layout did not intend (a weight split where the stream it joins is whole
makes XLA split the stream, then gather it before every matmul). Each
collective's bytes come from its result's shape, its group size from its
`replica_groups`, and the same ring arithmetic as the plan's: all-gather
(n-1)/n of the result, reduce-scatter (n-1) x the result (a shard),
all-reduce twice (n-1)/n. A collective inside a loop counts once.
"""

import math
import re

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>" + "|".join(_OPS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32,
         "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}


def sent_per_device(hlo_text: str, devices: int) -> dict:
    """Bytes one device sends, by kind of collective, and their total (a dict, JSON-ready)."""
    sent = {op.replace("-", "_"): 0.0 for op in _OPS}
    for line in hlo_text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)  # '/*index=5*/' inside tuple shapes
        found = _LINE.search(line)
        if not found:
            continue
        op, nbytes = found.group("op"), _bytes(found.group("shape"))
        n = _group_size(line, devices)
        if op == "all-reduce":
            share = 2 * (n - 1) / n * nbytes
        elif op == "all-gather":
            share = (n - 1) / n * nbytes
        elif op == "reduce-scatter":
            share = (n - 1) * nbytes
        else:
            share = nbytes
        sent[op.replace("-", "_")] += share
    sent = {key: round(value) for key, value in sent.items()}
    sent["total"] = sum(sent.values())
    return sent


def _bytes(shape: str) -> int:
    return sum(math.prod(int(d) for d in m.group("dims").split(",") if d)
               * _BITS.get(m.group("dtype"), 32) // 8 for m in _ARRAY.finditer(shape))


def _group_size(line: str, devices: int) -> int:
    """Devices per group: {{0,1},{2,3}}, the iota form [groups,size]<=[...], or
    mesh['axis_0'=4,'axis_1'=2] {'axis_1'}."""
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if explicit:
        return len(explicit.group(1).split(","))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if iota:
        return int(iota.group(2))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh.group(2)))
    return devices  # no groups: every device
