"""Bytes each device sends in a compiled program's collectives, read from its HLO text.

The check on `planning.planned_traffic`: XLA's SPMD partitioner decides
which collectives a sharded step really runs, and it may add some the
layout did not intend (a weight split where the stream it joins is whole
makes XLA split the stream, then gather it before every matmul). Each
collective's bytes come from its result's shape, its group size from its
`replica_groups`, and the same ring arithmetic as the plan's: all-gather
(n-1)/n of the result, reduce-scatter (n-1) x the result (a shard),
all-reduce twice (n-1)/n. A ragged all-to-all (a mixture of experts'
exchange on an expert axis) sends a data-dependent part of its buffers,
counted at (n-1)/n of the smaller of its operand and result: the copies a
device holds, when its tokens choose the experts evenly. A collective inside a loop counts once. With
several slices, what crosses between them is counted apart
(`network.hierarchical`), from which devices each group holds.
"""

import math
import re

import numpy as np

from tpu_keras.planning import network

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_RAGGED = "ragged-all-to-all"  # counted as an all-to-all
_LINE = re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>" + "|".join((_RAGGED,) + _OPS)
                   + r")(-start)?\((?P<first>%?[\w.\-]+)?")
_DEFINED = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>[a-z]+\d*\[[\d,]*\])", re.M)
_MEGASCALE = re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+send\(.*_xla_megascale_transfer_type="
                        r'"(?P<kind>[A-Z_]+)"')
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32,
         "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}


def sent_per_device(hlo_text: str, devices: int, slices: int = 1) -> dict:
    """Bytes one device sends, by kind of collective, and their total (a dict, JSON-ready).

    With `slices` > 1 the program's devices (logical ids, in mesh order) are
    `slices` contiguous blocks, slice = the outermost part of the data axis; a
    collective whose groups span slices puts what crosses them
    (`network.hierarchical`) under '<kind>_across_slices'.
    """
    sent = {op.replace("-", "_"): 0.0 for op in _OPS}
    if slices > 1:
        sent.update({f"{op.replace('-', '_')}_across_slices": 0.0 for op in _OPS})
    for each in _each(hlo_text, devices, slices):
        key = ("all-to-all" if each["op"] == _RAGGED else each["op"]).replace("-", "_")
        sent[key] += each["inside"]
        if each["across"]:
            sent[f"{key}_across_slices"] += each["across"]
    sent = {key: round(value) for key, value in sent.items()}
    sent["total"] = sum(sent.values())
    return sent


def listed(hlo_text: str, devices: int, slices: int = 1) -> list[dict]:
    """Each collective of the program, the same ones counted together (a list, JSON-ready,
    most bytes sent first): its kind, result shape, devices per group, how many of them
    the program has, and what one device sends in each over the chip interconnect inside
    a slice ('ici') and over the data-center network between slices ('dcn'); 'network'
    names which it crosses."""
    rows = {}
    for each in _each(hlo_text, devices, slices):
        key = (each["op"], each["shape"], each["group_size"], each["slices_spanned"])
        row = rows.setdefault(key, {"op": each["op"], "shape": each["shape"],
                                    "result_bytes": each["result_bytes"],
                                    "group_size": each["group_size"],
                                    "slices_spanned": each["slices_spanned"], "count": 0,
                                    "ici_bytes": 0.0, "dcn_bytes": 0.0})
        row["count"] += 1
        row["ici_bytes"] += each["inside"]
        row["dcn_bytes"] += each["across"]
    result = []
    for row in rows.values():
        row["ici_bytes"], row["dcn_bytes"] = round(row["ici_bytes"]), round(row["dcn_bytes"])
        row["sent_bytes"] = row["ici_bytes"] + row["dcn_bytes"]
        row["network"] = "+".join(name for name, value in (("ICI", row["ici_bytes"]),
                                                           ("DCN", row["dcn_bytes"])) if value) or "ICI"
        result.append(row)
    return sorted(result, key=lambda r: (-r["sent_bytes"], r["op"], r["shape"]))


def _each(hlo_text: str, devices: int, slices: int):
    """One dict per collective instruction of the program: kind, shape, bytes, group."""
    per_slice = devices // slices
    shapes = None  # each array instruction's result shape, by name: a ragged all-to-all's operand
    for line in hlo_text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)  # '/*index=5*/' inside tuple shapes
        found = _LINE.search(line)
        if not found:
            across = _MEGASCALE.search(line)
            if across:
                yield _between_slices(across, line, slices)
            continue
        op, shape = found.group("op"), found.group("shape")
        nbytes = _bytes(shape)
        if op == _RAGGED:
            if shapes is None:
                shapes = {m.group("name"): m.group("shape") for m in _DEFINED.finditer(hlo_text)}
            operand = shapes.get((found.group("first") or "").lstrip("%"))
            if operand and _bytes(operand) < nbytes:
                shape, nbytes = operand, _bytes(operand)
        if op == "collective-permute":
            pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", line.split(
                "source_target_pairs=", 1)[-1])]
            spanned = len({d // per_slice for pair in pairs for d in pair}) if pairs else 1
            n = spanned
        else:
            group = _groups(line, devices)[0]
            n = len(group)
            spanned = len({d // per_slice for d in group})
        moved = nbytes * network.ring(n) if op == _RAGGED else nbytes  # its own copies stay
        inside, across = network.hierarchical(op, moved, max(1, n // spanned), spanned)
        yield {"op": op, "shape": _plain(shape), "result_bytes": nbytes, "group_size": n,
               "slices_spanned": spanned, "inside": inside, "across": across}


def _between_slices(found, line: str, slices: int) -> dict:
    """A TPU multislice program's transfer over the data-center network: the TPU compiler
    compiles one slice's program, whose collectives span its own devices, and hands what
    crosses slices to the megascale runtime as a `send` of one device's shard, tagged
    with the kind of collective and the slices it joins (`_xla_megascale_target=
    "{1,2}x{0:15}"`: slices 1 and 2, devices 0 to 15). An all-reduce of a shard of B bytes
    over S slices sends 2 (S-1)/S B from each device; any other kind, its B."""
    op = found.group("kind").lower().replace("_", "-")
    shard = _ARRAY.search(found.group("shape"))
    nbytes = _bytes(shard.group(0)) if shard else 0
    target = re.search(r'_xla_megascale_target="\{([^}]*)\}', line)
    spanned = _count(target.group(1)) if target else slices
    across = (2 * network.ring(spanned) * nbytes if op == "all-reduce" else float(nbytes))
    return {"op": op, "shape": _plain(shard.group(0)) if shard else "", "result_bytes": nbytes,
            "group_size": spanned, "slices_spanned": spanned, "inside": 0.0, "across": across}


def _count(members: str) -> int:
    """How many a '1,2' or '0:15' (inclusive) list names."""
    total = 0
    for part in members.split(","):
        low, _, high = part.partition(":")
        total += int(high) - int(low) + 1 if high else 1
    return max(1, total)


def _plain(shape: str) -> str:
    """A result shape without its layout: 'bf16[512,128]'; a tuple's arrays counted:
    '(f32[128] x10, f32[])', or '(26 arrays)' when they are of more than 3 shapes."""
    arrays = [f"{m.group('dtype')}[{m.group('dims')}]" for m in _ARRAY.finditer(shape)]
    if len(arrays) == 1:
        return arrays[0]
    counts = {a: arrays.count(a) for a in arrays}
    if len(counts) > 3:
        return f"({len(arrays)} arrays)"
    return "(" + ", ".join(a + (f" x{n}" if n > 1 else "") for a, n in counts.items()) + ")"


def _bytes(shape: str) -> int:
    return sum(math.prod(int(d) for d in m.group("dims").split(",") if d)
               * _BITS.get(m.group("dtype"), 32) // 8 for m in _ARRAY.finditer(shape))


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """An iota tile assignment: [d0,d1,...]T(p0,p1,...) = arange, reshaped, transposed."""
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _groups(line: str, devices: int) -> list[list[int]]:
    """The device groups: {{0,1},{2,3}}, the iota form [groups,size]<=[...]T(...), or
    mesh['axis_0'=4,'axis_1'=2] (device_ids=(...)) {'axis_1'}; none given: every device."""
    explicit = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if explicit:
        return [[int(d) for d in g.split(",") if d]
                for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        return _iota(iota.group(3), iota.group(4)).reshape(int(iota.group(1)),
                                                             int(iota.group(2))).tolist()
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\]"
                     r"(?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", line)
    if mesh:
        axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = (_iota(mesh.group(2), mesh.group(3)) if mesh.group(2)
               else np.arange(math.prod(sizes))).reshape(sizes)
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(4))]
        rest = [i for i in range(len(names)) if i not in grouped]
        size = math.prod(sizes[i] for i in grouped)
        return ids.transpose(rest + grouped).reshape(-1, size).tolist()
    return [list(range(devices))]
