"""The planner's reports: the text `python -m tpu_keras.plan` prints for a plan
(`format_plan`), a layout search (`format_search`) and the TPU compiler's figures
(`format_measured`), from the JSON the arithmetic returns (`planning.slice_plan`,
`planning.layout_search`, `planning.tpu_compiler`). What a plan says of its objective
(DPO's pairs, GRPO's sampling) is the objective's own line (`Objective.plan_lines`)."""

from tpu_keras import objectives
from tpu_keras.parallelism import mesh as mesh_lib
from tpu_keras.planning import layout_search, network
from tpu_keras.planning.layout_report import format_bytes
from tpu_keras.planning.tpu_compiler import sent_terms, terms


MARGIN_NOTE = ("HBM is what the devices report usable, not the published capacity; --margin "
               "keeps room for XLA's own buffers, padding and fragmentation")


NETWORK_NOTE = ("estimated time: bytes over the published bandwidth (ICI: half the bidirectional "
                "figure per chip; DCN: the host network's share per chip), without latency or "
                "overlap with compute")


def format_plan(p: dict) -> str:
    """The plan as the command prints it: bytes per device, whether it fits, the largest batch."""
    mesh, d = p["mesh"], p["per_device"]
    note = {"parameters": "exact (the layout tool's arithmetic)", "optimizer": "exact",
            "gradients": "exact",
            "activations": "estimate: what the backward pass keeps"
                           + (f", remat {p['remat']}" if p.get("remat", "none") != "none"
                              else ", no rematerialisation")
                           + (", split as tensor parallelism splits them (errs high)"
                              if mesh["model"] > 1 else "")}
    where = f"{p['slices']} x {p['slice']}" if p.get("slices", 1) > 1 else p["slice"]
    lines = [f"{p['model']} on {where}: {p['devices']} devices on {p['hosts']} host(s), "
             f"{format_bytes(p['hbm_bytes_per_device'])} HBM per device",
             f"mesh {mesh_lib.describe({**mesh, mesh_lib.SLICES: p.get('slices', 1)})}, global batch "
             f"{p['global_batch']:,} ({p['per_replica_batch']:,} per replica), {p['precision']}"]
    if p.get("weights", {}).get("frozen"):
        lines.append(weights_line(p["weights"]))
    if p.get("experts"):
        lines.append(experts_line(p["experts"]))
    objective = objectives.REGISTRY.get(p.get("objective", "sft"), objectives.Objective())
    lines += objective.plan_lines(p)  # DPO's pairs, GRPO's completions, and their reference
    lines += ["", "per device"]
    labels = {"parameters": "parameters", "optimizer": "optimizer state",
              "gradients": "gradients", "activations": "activations"}
    if "reference" in d:
        labels["reference"] = "reference"
        note["reference"] = f"exact: {objective.name.upper()}'s frozen copy"
    if "sampling" in d:
        labels["sampling"] = "sampler cache"
        note["sampling"] = ("estimate: the KV cache and logits of the per-replica completions; "
                            "sampling and the step alternate, so the total counts the larger")
    for key, label in labels.items():
        lines.append(f"  {label:<16} {format_bytes(d[key]):>11}  {note[key]}")
    lines.append(f"  {'total':<16} {format_bytes(d['total']):>11}")
    lines += ["", f"sent per device per step: {format_bytes(p['sent_per_step']['total'])} "
                  f"({_sent_parts(p['sent_per_step'])})",
              f"  {format_network(p['network'])}", f"  {NETWORK_NOTE}"]
    if p.get("measured", {}).get("backend") == "tpu":
        lines += [""] + format_measured(p, p["measured"], format_bytes)
        if "sent_per_step" in p["measured"]:
            lines += measured_notes(p["sent_per_step"], p["measured"])
    elif "measured" in p:
        m = p["measured"]
        lines += ["", f"XLA's figures for the compiled step on {m['devices']} {m['backend']} "
                      "device(s), per device:",
                  f"  {'total':<16} {format_bytes(m['total']):>11}  arguments "
                  f"{format_bytes(m['arguments'])}, outputs {format_bytes(m['outputs'])}, "
                  f"temporaries {format_bytes(m['temporaries'])} (plan / XLA = "
                  f"{d['total'] / m['total']:.2f})",
                  f"  {'activations':<16} {format_bytes(m['activations']):>11}  the temporaries "
                  f"that grow with the batch (estimate / XLA = "
                  f"{d['activations'] / max(1, m['activations']):.2f})",
                  f"  {'sent per step':<16} {format_bytes(m['sent_per_step']['total']):>11}  by the "
                  f"compiled collectives ({_sent_parts(m['sent_per_step'])}; plan / XLA = "
                  f"{p['sent_per_step']['total'] / max(1, m['sent_per_step']['total']):.2f})"]
        lines += measured_notes(p["sent_per_step"], m)
    lines += ["", f"usable HBM: {format_bytes(p['usable_bytes_per_device'])} per device "
                  f"({p['margin']:.0%} kept free)", MARGIN_NOTE]
    share = d["total"] / p["usable_bytes_per_device"]
    compiled = p.get("measured", {}) if p.get("measured", {}).get("backend") == "tpu" else None
    if compiled:
        lines.append(("fits by the TPU compiler: yes, " if compiled["fits"] else
                      "fits by the TPU compiler: NO, ")
                     + (f"peak {format_bytes(compiled['peak'])}, {compiled['share_of_hbm']:.1%} of "
                        f"{format_bytes(compiled['hbm_bytes_per_device'])} HBM"
                        if compiled.get("peak") else "out of memory")
                     + ("" if compiled["fits"] else ": lower train.batch_size, split the weights "
                        "over mesh.fsdp or mesh.model, set train.remat, or use a larger slice"))
    if p.get("plan_fits", p["fits"]):
        lines.append(("the plan: " if compiled else "")
                     + (f"fits: yes, {share:.1%} of usable HBM" if share >= 0.001
                        else "fits: yes, under 0.1% of usable HBM"))
    else:
        lines.append(f"{'the plan: ' if compiled else ''}fits: NO, {share:.0%} of usable HBM: "
                     + _advice(p))
    if p["largest_global_batch"]:
        lines.append(f"largest global batch that fits: {p['largest_global_batch']:,} "
                     f"({p['largest_global_batch'] // (mesh_lib.batch_splits(mesh) * p.get('slices', 1)):,} per "
                     "replica)")
    else:
        lines.append(f"largest global batch that fits: none ({_what_fills(p)})")
    return "\n".join(lines)


def _state_bytes(p: dict) -> int:
    """Per device, what any batch needs: weights, optimizer state, gradients (and a reference)."""
    d = p["per_device"]
    return sum(d.get(key, 0) for key in ("parameters", "optimizer", "gradients", "reference"))


def _what_fills(p: dict) -> str:
    """Why no batch fits: the state alone, or one sequence's activations beside it."""
    if _state_bytes(p) >= p["usable_bytes_per_device"]:
        return "the weights, optimizer state and gradients alone fill HBM"
    return (f"the weights, optimizer state and gradients take {format_bytes(_state_bytes(p))}; "
            "one sequence's activations do not fit beside them")


def _advice(p: dict) -> str:
    """What to change when the plan does not fit: split the weights when they alone fill
    HBM, split or shorten each sequence's activations when they are what does not fit."""
    if _state_bytes(p) >= p["usable_bytes_per_device"] or p["per_replica_batch"] > 1:
        return ("lower train.batch_size, split the weights over mesh.fsdp or mesh.model (jax "
                "engine), or use a larger slice; --auto searches the layouts")
    return ("one sequence's activations "
            f"({format_bytes(p['per_device']['activations'])}) are what does not fit: split each "
            "sequence over mesh.context (jax engine), set train.remat=blocks and "
            "train.loss_chunks, or use a larger slice; --auto searches the layouts")


def _sent_parts(sent: dict) -> str:
    parts = [(key.replace("_", " "), value) for key, value in sent.items() if key != "total" and value]
    return ", ".join(f"{name} {format_bytes(value)}" for name, value in parts) or "nothing"


def format_seconds(seconds) -> str:
    if seconds is None:
        return "no published bandwidth"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def format_network(n: dict) -> str:
    """'inside slices 1.2 GiB (ICI, 3.4 ms), across slices 10 MiB (DCN, 5.6 ms): 9.0 ms'."""
    inside = f"inside the slice {format_bytes(n['inside_slice'])} (ICI, {format_seconds(n['ici_seconds'])})"
    if n["slices"] == 1:
        return inside
    return (f"{inside}, across the {n['slices']} slices {format_bytes(n['across_slices'])} "
            f"(DCN, {format_seconds(n['dcn_seconds'])}): {format_seconds(n['seconds'])} in all")


def measured_notes(sent: dict, m: dict) -> list[str]:
    """The across-slice check, and what XLA:CPU sends that a TPU would not."""
    lines = []
    if m.get("slices", 1) > 1:
        planned, compiled = network.across_slices(sent), network.across_slices(m["sent_per_step"])
        tpu = m.get("backend") == "tpu"
        how = ("in the transfers the TPU compiler hands the data-center network (DCN)" if tpu
               else "by the compiled collectives whose groups span slices")
        lines.append(f"  {'across slices':<16} {format_bytes(compiled):>11}  {how} (plan / "
                     f"{'compiler' if tpu else 'XLA'} = {planned / max(1, compiled):.2f})")
    if "cpu_sent_per_step" in m:
        lines.append(f"  note: XLA:CPU's own program sends {format_bytes(m['cpu_sent_per_step']['total'])} "
                     "after its backend passes, among them all-reduce-promotion and "
                     "float-normalization-bf16, which widen bf16 collectives to float32 (a TPU "
                     "reduces bf16 natively); the figures above are the SPMD partitioner's "
                     "collectives, in the dtypes a TPU sends")
    return lines


def weights_line(weights: dict) -> str:
    """'weights: frozen bfloat16 14.96 GiB, trainable float32 26.00 MiB (all devices together)'."""
    parts = [f"{kind} {dtype} {format_bytes(size)}" for kind in ("frozen", "trainable")
             for dtype, size in sorted(weights[kind].items(), key=lambda item: -item[1])]
    return f"weights: {', '.join(parts)} (all devices together)"


def experts_line(experts: dict) -> str:
    """'mixture of experts: 30,532,122,624 parameters, 3,335,826,432 active per token (8 of 128 experts)'."""
    return (f"mixture of experts: {experts['total']:,} parameters, {experts['active']:,} active per "
            f"token ({experts['top_k']} of {experts['experts']} experts)")


def format_measured(p: dict, m: dict, format_bytes) -> list[str]:
    """The compiler's lines of the plan: memory per device against HBM, the step-time
    estimate and its MFU, and the collectives, most bytes first."""
    where = (f"{m['devices']} device{'s' * (m['devices'] > 1)} ({m['topology']}"
             + (f" x {m['slices']} slices" if m["slices"] > 1 else "") + ")")
    hbm = format_bytes(m["hbm_bytes_per_device"])
    if "out_of_memory" in m:
        lines = [f"{m['compiler']} for {where}, {m['seconds']['compile']:.0f} s: out of memory",
                 f"  does not fit: {m['out_of_memory']}"]
        if m.get("peak"):
            lines.append(f"  {'needs at least':<16} {format_bytes(m['peak']):>11}  of {hbm} HBM "
                         f"per device ({m['share_of_hbm']:.0%}), by the compiler's words above")
        return lines
    lines = [f"{m['compiler']}, the step compiled for {where} in "
             f"{m['seconds']['compile']:.0f} s, per device:"]
    d = p["per_device"]
    lines += [f"  {'arguments':<16} {format_bytes(m['arguments']):>11}  weights, optimizer state, "
              "the batch",
              f"  {'outputs':<16} {format_bytes(m['outputs']):>11}  less those written over a "
              "donated argument",
              f"  {'temporaries':<16} {format_bytes(m['temporaries']):>11}  gradients, activations, "
              "workspace",
              f"  {'program':<16} {format_bytes(m['program']):>11}  the compiled code",
              f"  {'peak':<16} {format_bytes(m['peak']):>11}  {m['share_of_hbm']:.1%} of {hbm} HBM: "
              + ("fits" if m["fits"] else "does NOT fit")
              + f" (plan / compiler = {d['total'] / max(1, m['peak']):.2f})"]
    lines += _format_terms(p, m, format_bytes)
    if m.get("splash_attention_layers"):
        lines.append(f"  {'attention':<16} {'splash':>11}  the TPU's fused kernel in "
                     f"{m['splash_attention_layers']} layers ({m['fused_kernels']} kernel calls "
                     "in the program)")
    if "sampling" in m:
        sampled = m["sampling"]
        lines.append(f"  {'sampler':<16} " + (
            f"{format_bytes(sampled['peak']):>11}  GRPO's sampling program, compiled too: its peak "
            f"({format_bytes(sampled['temporaries'])} of temporaries, the KV cache among them; "
            f"the plan's cache: {format_bytes(d.get('sampling', 0))}); "
            + ("fits" if sampled["fits"] else "does NOT fit")
            if "peak" in sampled else f"{'-':>11}  GRPO's sampling program does not fit: "
                                      f"{sampled['out_of_memory']}"))
    if m["step_seconds"] is not None:
        mfu = (f", MFU {m['mfu']:.1%} ({m['mfu_of']} of the update over that time and the "
               "bf16 peak)" if m.get("mfu") is not None else "")
        covers = m.get("estimate_covers", "the step")
        lines.append(f"  {'step time':<16} {m['step_seconds'] * 1e3:>8.2f} ms  the compiler's "
                     f"estimate{mfu}" + ("" if covers == "the step" else f"; it covers {covers}"))
    else:
        lines.append(f"  {'step time':<16} {'none':>11}  the compiler gave no estimate for this "
                     "program")
    lines.append(f"  {'sent per step':<16} {format_bytes(m['sent_per_step']['total']):>11}  by the "
                 f"compiled collectives (plan / compiler = "
                 f"{p['sent_per_step']['total'] / max(1, m['sent_per_step']['total']):.2f}):")
    by_network = {name: sum(c[f"{name.lower()}_bytes"] for c in m["collectives"])
                  for name in ("ICI", "DCN")}
    lines.append(f"    over the chip interconnect (ICI) {format_bytes(by_network['ICI'])}"
                 + (f", over the data-center network (DCN) {format_bytes(by_network['DCN'])}"
                    if m["slices"] > 1 else "") + "; the largest:")
    shown = m["collectives"][:8]
    for c in shown:
        lines.append(f"    {c['op']:<18} {c['shape'][:40]:<40} x{c['count']:<4} over "
                     f"{c['group_size']:>4} devices  {format_bytes(c['sent_bytes']):>11}  "
                     f"{c['network']}")
    rest = m["collectives"][len(shown):]
    if rest:
        lines.append(f"    and {len(rest)} more, {format_bytes(sum(c['sent_bytes'] for c in rest))} "
                     "in all (--json lists each)")
    if not m["collectives"]:
        lines.append("    none")
    by_kind = sent_terms(p, m)
    if "differs_most" in by_kind:
        kind = by_kind["differs_most"]
        lines.append(f"    differs most: {kind.replace('_', '-')}, plan "
                     f"{format_bytes(by_kind[kind]['plan'])} against compiled "
                     f"{format_bytes(by_kind[kind]['compiler'])}: {by_kind[kind]['why']}")
    return lines


def _format_terms(p: dict, m: dict, format_bytes) -> list[str]:
    """Lines for the plan's terms against the compiler's, when the totals part by more than
    `MEMORY_BOUND`: which term differs most, and why."""
    by_term = terms(p, m)
    if "differs_most" not in by_term:
        return []
    lines = ["  the plan against the compiler, term by term:"]
    for term in ("weights and optimizer state", "gradients and activations", "program"):
        t = by_term[term]
        lines.append(f"    {term:<28} plan {format_bytes(t['plan']):>11}  compiler "
                     f"{format_bytes(t['compiler']):>11}")
    most = by_term[by_term["differs_most"]]
    lines.append(f"    differs most: {by_term['differs_most']}: {most['why']}")
    return lines


def format_search(s: dict, rows: int = 12) -> str:
    """The search as the command prints it: the best candidates, then the recommendation."""
    fitting = [c for c in s["candidates"] if c["fits"]]
    slices = s.get("slices", 1)
    where = f"{slices} x {s['slice']}" if slices > 1 else s["slice"]
    lines = [f"{s['model']} ({s['parameters']:,} parameters) on {where}: {s['devices']} devices "
             f"on {s['hosts']} host(s), {format_bytes(s['usable_bytes_per_device'])} usable HBM per "
             f"device ({format_bytes(s['hbm_bytes_per_device'])} less {s['margin']:.0%}), "
             f"{s['precision']}",
             f"batch per update: {s['update_batch']:,}; {len(s['candidates'])} candidates "
             f"(mesh x remat), {len(fitting)} fit; {len(s['skipped'])} meshes skipped", ""]
    if s.get("weights", {}).get("frozen"):
        lines.insert(2, weights_line(s["weights"]))
    header = ("data", "fsdp", "model", "remat", "batch", "accum", "params", "optimizer",
              "grads", "activations", "total", "sent/update", "across slices", "time")
    if slices == 1:
        header = header[:-2] + header[-1:]
    table = [header]
    for c in fitting[:rows]:
        mesh, d, n = c["mesh"], c["per_device"], c["network"]
        row = (str(mesh["data"]), str(mesh["fsdp"]), str(mesh["model"]), c["remat"],
               str(c["batch_per_replica"]), str(c["grad_accum_steps"]),
               format_bytes(d["parameters"]), format_bytes(d["optimizer"]),
               format_bytes(d["gradients"]),
               format_bytes(d["activations"]) + ("*" if mesh["model"] > 1 else ""),
               format_bytes(d["total"]), format_bytes(c["sent_per_step"]["total"]),
               format_bytes(n["across_slices"]), format_seconds(n["seconds"]))
        table.append(row if slices > 1 else row[:-2] + row[-1:])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) if i == 3 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))) for row in table]
    if len(fitting) > rows:
        lines.append(f"... and {len(fitting) - rows} more that fit (--json lists them all)")
    expert = max((c["mesh"].get("expert", 1) for c in s["candidates"]), default=1)
    lines += ["", "per device; data, fsdp, model: one slice's mesh"
                  + (f" (with the config's expert={expert} in each, not searched)" if expert > 1 else "")
                  + (f", data parallel across the {slices} slices" if slices > 1 else "")
                  + "; batch: examples per batch split per micro-batch; accum: micro-batches "
                  "per update; sent: bytes each device sends per update"
                  + ("; across slices: the part of it that crosses the data-center network"
                     if slices > 1 else "") + "; time: its " + NETWORK_NOTE,
              "* model > 1: activations split where tensor parallelism splits them, followed through "
              "the traced step; the estimate errs high", MARGIN_NOTE]
    for skip in s["skipped"][:3]:
        lines.append(f"skipped {mesh_lib.describe(skip['mesh'])}: {skip['reason']}")
    if "compiled" in s:
        lines += ["", *format_compiled(s)]
    best = s["recommended"]
    if best is None and "compiled" in s:
        lines += ["", f"nothing the TPU compiler compiled fits: compile more candidates "
                      f"(--compiled={len(s['compiled']) * 2}), use a larger slice, a smaller "
                      "model, or a smaller batch per update"]
        return "\n".join(lines)
    if best is None:
        lines += ["", "nothing fits: use a larger slice, a smaller model, or a smaller batch per update "
                      "(train.batch_size x train.grad_accum_steps)"]
        return "\n".join(lines)
    sent = best["sent_per_step"]
    parts = ", ".join(f"{key.replace('_', ' ')} {format_bytes(value)}" for key, value in sent.items()
                      if key != "total" and value)
    least = ("the least estimated communication time" if best["network"]["seconds"] is not None
             else "the least communication (no published bandwidth for this generation)")
    if "compiled" in s:
        least = (f"{s['chosen_by']}, the best of the {len(s['compiled'])} best-planned layouts "
                 "compiled" + ("" if best is s["plan_recommended"] else
                               "; the plan alone would have chosen "
                               + layout_search.layout(s["plan_recommended"], slices)))
    else:
        least += " of those that fit"
    lines += ["", f"recommended: {layout_search.layout(best, slices)}: {least}",
              f"  {format_bytes(best['per_device']['total'])} per device; sends "
              f"{format_bytes(sent['total'])} per update ({parts or 'nothing'})",
              f"  {format_network(best['network'])}"]
    if s.get("measured", {}).get("backend") == "tpu":
        lines += ["  " + line for line in format_measured(best, s["measured"],
                                                                        format_bytes)]
        if "sent_per_step" in s["measured"]:
            lines += measured_notes(sent, s["measured"])
    elif "measured" in s:
        m = s["measured"]
        lines += [f"  XLA's compiled step on {m['devices']} {m['backend']} device(s) sends "
                  f"{format_bytes(m['sent_per_step']['total'])} per device (plan / XLA = "
                  f"{sent['total'] / max(1, m['sent_per_step']['total']):.2f})"]
        lines += measured_notes(sent, m)
    lines.append(f"  {s['flags']}")
    return "\n".join(lines)


def format_compiled(s: dict) -> list[str]:
    """The compiled candidates, the plan's figures beside the TPU compiler's."""
    header = ("data", "fsdp", "model", "remat", "batch", "accum", "plan", "compiler peak",
              "plan sent", "compiled sent", "plan comm", "compiler step", "")
    table = [header]
    for row in s["compiled"]:
        mesh, sent = row["mesh"], row["sent"]
        table.append((str(mesh["data"]), str(mesh["fsdp"]), str(mesh["model"]), row["remat"],
                      str(row["batch_per_replica"]), str(row["grad_accum_steps"]),
                      format_bytes(row["plan_bytes"]),
                      (format_bytes(row["peak"]) if row["peak"] else "?") + ("" if row["fits"]
                                                                             else " NO FIT"),
                      format_bytes(row["plan_sent"]), format_bytes(sent) if sent is not None else "-",
                      format_seconds(row["plan_seconds"]),
                      f"{row['step_seconds'] * 1e3:.2f} ms" if row["step_seconds"] else "none",
                      "<- chosen" if row["chosen"] else ""))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    compiler = s["measured"]["compiler"]
    return ([f"the {len(s['compiled'])} best-planned layouts, compiled by the {compiler}, per "
             "device:"]
            + ["  " + "  ".join(cell.ljust(w) if i in (3, 12) else cell.rjust(w)
                                for i, (cell, w) in enumerate(zip(r, widths))).rstrip()
               for r in table]
            + ["  plan: the plan's bytes; compiler peak: arguments, outputs, temporaries and code; "
               "sent: per update; plan comm: the plan's communication time; compiler step: the "
               "compiler's estimate of the whole step"])
