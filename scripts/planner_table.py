"""The planner held to the TPU compiler: every shipped config on four slices, in mixed_bfloat16.

    python scripts/planner_table.py [--slices=v5litepod-8,...] [--configs=lm_stdlib,...]

Run by `python scripts/benchmark.py --planner_table`, in a process of its
own (the jax engine is chosen before Keras loads). For each config of
`configs/` (its default variant, on the jax engine with its own mesh) and
each slice, `plan --measure` on the TPU compiler: the plan's bytes per
device against the compiler's peak, and the plan's bytes sent per update
against the compiled collectives'. Prints one JSON object: a row per
config and slice with both figures and their ratios, whether each is
within the planner's bounds (memory 10%, bytes sent 15%), and for a row
outside them, which term differs most (the compiler's arguments, against
the plan's weights and optimizer state; its temporaries, against the
plan's gradients and activations). A config that cannot run on a slice
(a batch that does not divide) is a row with its one-line error.
"""

from tpu_keras import lean_imports

lean_imports.install()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from tpu_keras.cluster import engine  # noqa: E402

engine.select("jax")

from absl import flags  # noqa: E402

from tpu_keras import cli  # noqa: E402
from tpu_keras.errors import UserError  # noqa: E402
from tpu_keras.planning import slice_plan, tpu_compiler  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "configs"))
MEMORY_BOUND, SENT_BOUND = tpu_compiler.MEMORY_BOUND, tpu_compiler.SENT_BOUND
_SLICES = flags.DEFINE_list("slices", ["v5litepod-8", "v5litepod-16", "v5p-64", "2xv5litepod-16"],
                            "The slices to plan for.")
# configs/finetune.py names no model until model.preset or its architecture is given: the
# pod guide's 8B Llama LoRA row is its plan (benchmark.py --tpu_compile).
_CONFIGS = flags.DEFINE_list("configs", ["lm_stdlib", "digits", "llama_stdlib", "instruct_stdlib"],
                             "Config modules of configs/.")


def load(name):
    module = __import__(name)
    config = module.get_config()
    config.engine = "jax"
    config.train.precision = "mixed_bfloat16"
    return config


def row(name, slice_name):
    config = load(name)
    try:
        p = slice_plan.plan(config, slice_name, measure=True, compiler="tpu")
    except UserError as error:
        return {"config": name, "slice": slice_name, "error": str(error)}
    m, d = p["measured"], p["per_device"]
    result = {"config": name, "slice": slice_name, "mesh": p["mesh"], "devices": p["devices"],
              "plan_bytes": d["total"], "compiler_peak": m.get("peak"), "fits": m["fits"],
              "scheduled_peak": m.get("scheduled_peak")}
    if "out_of_memory" in m:
        return {**result, "out_of_memory": m["out_of_memory"]}
    sent, compiled = p["sent_per_step"]["total"], m["sent_per_step"]["total"]
    result.update(memory_ratio=round(d["total"] / m["peak"], 3),
                  sent_ratio=round(sent / compiled, 3) if compiled else None,
                  plan_sent=sent, compiled_sent=compiled)
    result["memory_within"] = abs(result["memory_ratio"] - 1) <= MEMORY_BOUND
    result["sent_within"] = compiled == sent == 0 or (
        result["sent_ratio"] is not None and abs(result["sent_ratio"] - 1) <= SENT_BOUND)
    result["terms"] = tpu_compiler.terms(p, m)
    result["differs_most"] = result["terms"].pop("differs_most", None)
    result["sent_terms"] = tpu_compiler.sent_terms(p, m)
    result["sent_differs_most"] = result["sent_terms"].pop("differs_most", None)
    return result


def main(argv):
    del argv
    rows = [row(name, slice_name) for name in _CONFIGS.value for slice_name in _SLICES.value]
    measured = [r for r in rows if "memory_ratio" in r]
    print(json.dumps({
        "compiler": tpu_compiler.name(), "precision": "mixed_bfloat16",
        "bounds": {"memory": MEMORY_BOUND, "sent": SENT_BOUND},
        "memory_within": sum(r["memory_within"] for r in measured),
        "sent_within": sum(r["sent_within"] for r in measured), "measured": len(measured),
        "rows": rows}, indent=1), flush=True)


if __name__ == "__main__":
    cli.start(main)
