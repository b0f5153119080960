"""`python -m tpu_keras.plan --auto`: the mesh, remat setting and micro-batch that fit a slice
with the least estimated communication time.

Every way to write the slice's devices as data x fsdp x model is tried with
each remat setting (`mesh.expert`, a mixture of experts' expert parallelism,
is not searched: every candidate keeps the config's, 1 by default). A language
model's sequence is split over `mesh.context` only where nothing fits without
it, and then no further than it must be (`_contexts`). The
update's batch (`train.batch_size` x `train.grad_accum_steps`, what the
config trains on per update) stays fixed: a candidate takes the largest
micro-batch per batch split that fits in memory and divides the update's
share of each split, and accumulates the rest. Of the candidates that fit, the recommendation is the one whose
communication takes the least estimated time per update
(`planning.planned_traffic`, `planning.network`): fsdp saves memory
but gathers every weight twice a micro-batch, model parallelism reduces
activations, and accumulation repeats all of it per micro-batch. On
several slices (`--tpu=2xv5litepod-256`) every candidate is one slice's
mesh, with data parallelism across the slices (weights never split across
them), and a byte across slices costs what the data-center network makes
it cost, not what the chip interconnect does. Without published bandwidth
(v2, v3) the least bytes decide. Ties go to the least recomputation
(no remat, then 'activations', then 'blocks'), then to less memory. Meshes the layout rules cannot take (a dimension that does
not divide, a large weight no model rule covers) are listed as skipped,
with the reason.
"""

import copy
import math

from tpu_keras import objectives
from tpu_keras.config import REMAT_MODES
from tpu_keras.errors import UserError
from tpu_keras.parallelism import mesh as mesh_lib
from tpu_keras.planning import compiled_step, slice_plan, tpu_compiler
from tpu_keras.planning.slice_plan import Footprint, usable_bytes


def search(config, slice_name: str, margin: float = 0.1, measure: bool = False,
           compiler: str = "cpu", compiled: int = 3) -> dict:
    """Every candidate layout of `config` on the slice, and the recommended one (a dict,
    JSON-ready). With `measure` and `compiler` 'tpu', the TPU compiler compiles the
    `compiled` best-planned candidates and its figures choose (`compiled_choice`); with
    'cpu', XLA:CPU compiles the plan's choice on fake devices (the model is allocated)."""
    slices, found = slice_plan.tpu_slices(config, slice_name)
    usable = usable_bytes(found, margin)
    footprint = Footprint(config)
    update_batch = config.train.batch_size * config.train.grad_accum_steps
    candidates, skipped = [], []
    for context in _contexts(config, found.devices):
        for mesh in meshes(found.devices, _kept(config, "expert"), context):
            splits = mesh_lib.batch_splits(mesh) * slices
            if update_batch % splits:
                skipped.append({"mesh": mesh, "reason": f"the batch of {update_batch} does not "
                                                        f"divide over {splits} batch splits"})
                continue
            try:
                footprint.layout(tuple(mesh.get(axis, 1) for axis in mesh_lib.AXES))  # the rules' checks
            except UserError as error:
                skipped.append({"mesh": mesh, "reason": str(error)})
                continue
            for remat in footprint.remat_modes:
                candidates.append(_candidate(footprint, found, slices, mesh, remat,
                                             update_batch // splits, usable))
        if any(c["fits"] for c in candidates):
            break  # the sequence is split only as far as one must be for it to fit
    fitting = [c for c in candidates if c["fits"]]
    best = min(fitting, key=_preference, default=None)
    result = {
        "model": config.model.name, "slice": found.name, "slices": slices,
        "devices": found.devices * slices, "hosts": found.hosts * slices, "hbm_bytes_per_device": found.hbm_bytes_per_device, "margin": margin,
        "usable_bytes_per_device": usable, "precision": footprint.precision,
        "parameters": sum(math.prod(v.shape) for v in footprint.model.weights),
        "weights": footprint.weight_dtypes,
        "update_batch": update_batch,
        "candidates": sorted(candidates, key=lambda c: (not c["fits"], _preference(c))),
        "skipped": skipped,
        "recommended": best,
        "flags": flags(best) if best else None,
    }
    if measure and best and compiler == "tpu":
        result.update(compiled_choice(config, slice_name, fitting, compiled))
    elif measure and best:
        result["measured"] = compiled_step.measure(configured(config, best), best["mesh"],
                                                   best["batch_per_replica"], footprint.state_bytes,
                                                   slices)
    return result


def compiled_choice(config, slice_name: str, fitting: list[dict], count: int) -> dict:
    """The TPU compiler's figures for the `count` best-planned of the `fitting` candidates, and
    its choice among them: of those whose peak fits HBM, the least step-time estimate, or,
    where the compiler gives no estimate for one of them, the fewest bytes sent, then the
    least peak. The plan ranks the candidates; the compiler, which sees the fused program,
    overlaps and all, has the last word.

    Returns {'compiled': a row per compiled candidate, plan and compiler side by side,
    'chosen_by', 'plan_recommended', 'recommended', 'flags', 'measured' (the chosen one's
    figures)}; 'recommended' is None where nothing compiled fits."""
    ranked = sorted(fitting, key=_preference)[:count]
    for candidate in ranked:
        candidate["measured"] = tpu_compiler.measure(configured(config, candidate), slice_name,
                                                     candidate["mesh"],
                                                     candidate["batch_per_replica"])
    fits = [c for c in ranked if c["measured"]["fits"]]
    timed = all(c["measured"].get("step_seconds") is not None for c in fits)
    by = ("the compiler's step-time estimate" if timed else
          "the bytes the compiled collectives send (the compiler gave no step-time estimate "
          "for every one)")

    def compiled_preference(c):
        m = c["measured"]
        return ((m["step_seconds"] if timed else 0), m["sent_per_step"]["total"], m["peak"])

    best = min(fits, key=compiled_preference, default=None)
    rows = [{"mesh": c["mesh"], "remat": c["remat"], "batch_per_replica": c["batch_per_replica"],
             "grad_accum_steps": c["grad_accum_steps"], "plan_bytes": c["per_device"]["total"],
             "plan_sent": c["sent_per_step"]["total"], "plan_seconds": c["network"]["seconds"],
             "peak": c["measured"]["peak"], "fits": c["measured"]["fits"],
             "sent": c["measured"].get("sent_per_step", {}).get("total"),
             "step_seconds": c["measured"].get("step_seconds"), "chosen": c is best}
            for c in ranked]
    return {"compiled": rows, "chosen_by": by, "plan_recommended": ranked[0],
            "recommended": best, "flags": flags(best) if best else None,
            "measured": (best or ranked[0])["measured"]}


def meshes(devices: int, expert: int = 1, context: int = 1) -> list[dict]:
    """Every {'data', 'fsdp', 'expert', 'context', 'model'} whose product is `devices`, with
    `expert` and `context` as given (none where they do not divide them)."""
    if devices % (expert * context):
        return []
    devices //= expert * context
    divisors = [n for n in range(1, devices + 1) if devices % n == 0]
    return [{"data": devices // (fsdp * model), "fsdp": fsdp, "expert": expert, "context": context,
             "model": model}
            for fsdp in divisors for model in divisors if (devices // fsdp) % model == 0]


def _contexts(config, devices: int) -> list[int]:
    """The `mesh.context` sizes to search, in the order tried: the config's own where it sets
    one; otherwise 1, then each size that divides the devices and the sequence, smallest
    first. The search stops at the first size with a candidate that fits: splitting a sequence
    gathers its keys and values in every layer, which the plan's traffic does not count, so
    it is the last resort for a sequence whose activations fit no other way."""
    kept = _kept(config, mesh_lib.CONTEXT)
    length = config.model.get("context_length", 0)
    if kept > 1 or not length or not objectives.of(config).splits_sequences:
        return [kept]
    return [1] + [c for c in range(2, devices + 1) if devices % c == 0 and length % c == 0]


def _kept(config, axis: str) -> int:
    """The config's `mesh.expert` or `mesh.context`, which every candidate keeps (-1, the
    devices left over, is not searched either: 1)."""
    return max(1, int(dict(config.mesh).get(axis, 1)))


def _needs_jax(mesh: dict, slices: int) -> bool:
    return slices > 1 or any(mesh.get(axis, 1) > 1 for axis in ("fsdp", "expert", "context", "model"))


def flags(candidate: dict) -> str:
    """The command-line flags that train with `candidate`."""
    mesh, slices = candidate["mesh"], candidate.get("slices", 1)
    return " ".join([
        *(["--config.engine=jax"] if _needs_jax(mesh, slices) else []),
        *([f"--config.mesh.slices={slices}"] if slices > 1 else []),
        *(f"--config.mesh.{axis}={mesh[axis]}" for axis in mesh_lib.AXES if axis in mesh),
        f"--config.train.remat={candidate['remat']}",
        f"--config.train.batch_size={candidate['batch_per_replica'] * mesh_lib.batch_splits(mesh) * slices}",
        f"--config.train.grad_accum_steps={candidate['grad_accum_steps']}"])


def configured(config, candidate: dict):
    """A copy of `config` that trains with `candidate`."""
    config = copy.deepcopy(config)
    mesh, slices = candidate["mesh"], candidate.get("slices", 1)
    if _needs_jax(mesh, slices):
        config.engine = "jax"
    config.mesh = {**config.mesh, **mesh, "slices": slices}
    config.train.remat = candidate["remat"]
    config.train.batch_size = candidate["batch_per_replica"] * mesh_lib.batch_splits(mesh) * slices
    config.train.grad_accum_steps = candidate["grad_accum_steps"]
    return config


def _candidate(footprint, found, slices: int, mesh: dict, remat: str, share: int,
               usable: int) -> dict:
    """`mesh` (one slice's) and `remat` at the largest micro-batch that fits and
    divides `share`, each batch split's examples per update."""
    largest = footprint.largest_batch(mesh, remat, usable)
    batch = max((b for b in range(1, min(largest, share) + 1) if share % b == 0), default=0)
    candidate = {"mesh": mesh, "slices": slices, "remat": remat, "fits": batch > 0,
                 "largest_batch_per_replica": largest}
    if batch:
        steps = share // batch
        sent = footprint.sent_per_step(mesh, batch, steps, slices)
        candidate.update(batch_per_replica=batch, grad_accum_steps=steps,
                         per_device=footprint.per_device(mesh, batch, remat),
                         sent_per_step=sent,
                         network=slice_plan.network_estimate(sent, found, slices))
    else:
        candidate["per_device"] = footprint.per_device(mesh, 1, remat)
    return candidate


def _preference(c: dict):
    if not c["fits"]:
        return (float("inf"), float("inf"), 0, 0)
    seconds = c["network"]["seconds"]
    return (c["sent_per_step"]["total"] if seconds is None else seconds, c["sent_per_step"]["total"],
            REMAT_MODES.index(c["remat"]), c["per_device"]["total"])


def layout(c: dict, slices: int) -> str:
    """'data=8 x fsdp=2, remat none, 4 per batch split x 2 micro-batch(es)'."""
    return (f"{mesh_lib.describe({**c['mesh'], mesh_lib.SLICES: slices})}, remat {c['remat']}, "
            f"{c['batch_per_replica']} per batch split x {c['grad_accum_steps']} micro-batch(es)")


