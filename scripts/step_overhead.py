"""What the toolkit's training step costs over plain Keras's, by the TPU compiler's estimate.

    python scripts/step_overhead.py [--config=configs/x.py --config.* overrides ...]

Run by `python scripts/benchmark.py --tpu_step_overhead`, in a process of its
own (the jax engine must be chosen before Keras loads). For one model, batch
and mesh on a v5litepod-8, libtpu compiles ahead of time, with nothing
allocated (`planning.tpu_compiler`):

- `toolkit`: the run's guarded step (the gradients' global norm, the
  non-finite check and the revert of a non-finite update);
- `keras`: plain Keras's `train_step` for the same model, optimizer, loss
  and metrics, as `fit` compiles it with `jit_compile=True`;
- `toolkit_accumulating`: the guarded step of 4 micro-batches, one update;
- `keras_accumulating`: plain Keras's step with the optimizer's
  `gradient_accumulation_steps=4`, one micro-batch per step: four of them
  make the same update.

Prints one JSON object: each variant's step-time estimate, its HBM peak and
the bytes its collectives send, the ratios the benchmark quotes (the
guard's cost, and accumulation's: the toolkit's one step against plain
Keras's four), and where the accumulating step's extra peak goes.
"""

from tpu_keras import lean_imports

lean_imports.install()

import json  # noqa: E402
import sys  # noqa: E402

from tpu_keras.cluster import engine  # noqa: E402

engine.select("jax")

from ml_collections import config_flags  # noqa: E402

from tpu_keras import cli  # noqa: E402
from tpu_keras import objectives  # noqa: E402
from tpu_keras.parallelism import mesh as mesh_lib  # noqa: E402
from tpu_keras.planning import slice_plan, tpu_compiler  # noqa: E402

TPU = "v5litepod-8"
MICRO_BATCHES = 4
# A gpt of about 1.2B parameters (lm_stdlib:1b's width and depth) at 1,024 tokens, its weights
# and optimizer state split 8 ways: a step of the size a pod trains, compiled in minutes here.
DEFAULT = ("--config=configs/lm_stdlib.py:1b", "--config.engine=jax", "--config.mesh.data=1",
           "--config.mesh.fsdp=8", "--config.model.context_length=1024",
           "--config.train.batch_size=16", "--config.train.remat=activations")
_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file, with --config.* "
                                          "overrides (default: the gpt above)")


def variant(config, step, accumulate):
    config = config.copy_and_resolve_references()
    config.train.grad_accum_steps = accumulate
    slices, found = slice_plan.tpu_slices(config, TPU)
    mesh = slice_plan.one_slice_mesh(config, found)
    per_replica = config.train.batch_size // (mesh["data"] * mesh["fsdp"])
    # The same attention in both (keras-hub's call of Keras's): the guard is what is weighed.
    m = tpu_compiler.measure(config, TPU, mesh, per_replica, step=step, attention="keras")
    return {"step_seconds": m.get("step_seconds"), "peak": m.get("peak"), "fits": m["fits"],
            "sent": m.get("sent_per_step", {}).get("total"),
            "collectives": len(m.get("collectives", [])), "flops_per_device": m.get("flops_per_device"),
            "bytes_accessed_per_device": m.get("bytes_accessed_per_device"),
            "compile_seconds": m["seconds"]["compile"], "mesh": mesh, "batch_per_replica": per_replica}


def ratio(a, b):
    return round(a / b, 6) if a and b else None


def accumulation_extra(config, results) -> dict:
    """Where the accumulating step's extra HBM goes: under mixed precision the TPU compiler
    moves each weight's bf16 cast out of the micro-batch loop (the casts do not change from
    one micro-batch to the next) and keeps the copies until the loop ends, where Keras's
    step, with no loop, frees each cast once its layer has run: half the float32 weights
    per device, next to the peaks' difference (docs/performance.md)."""
    toolkit, keras = results["toolkit_accumulating"]["peak"], results["keras_accumulating"]["peak"]
    if not (toolkit and keras):
        return {}
    footprint = slice_plan.Footprint(config)  # the model again, nothing allocated
    mesh = results["toolkit_accumulating"]["mesh"]
    weights = footprint.layout(tuple(mesh.get(axis, 1) for axis in mesh_lib.AXES))["totals"]
    bf16 = footprint.precision == "mixed_bfloat16"
    copies = weights["parameters"]["bytes_per_device"] // 2 if bf16 else 0
    return {"bytes": toolkit - keras, "bf16_weight_copies_held_through_the_loop": copies,
            "unexplained": toolkit - keras - copies,
            "where": "the TPU compiler hoists the weights' bf16 casts out of the micro-batch loop "
                     "and holds them until it ends; Keras's step has no loop"}


def main(argv):
    del argv
    config = _CONFIG.value
    objectives.check(config)
    results = {"toolkit": variant(config, "toolkit", 1), "keras": variant(config, "keras", 1),
               "toolkit_accumulating": variant(config, "toolkit", MICRO_BATCHES),
               "keras_accumulating": variant(config, "keras", MICRO_BATCHES)}
    seconds = {name: r["step_seconds"] for name, r in results.items()}
    keras_update = seconds["keras_accumulating"] * MICRO_BATCHES if seconds["keras_accumulating"] else None
    print(json.dumps({
        "tpu": TPU, "compiler": tpu_compiler.name(), "flags": sys.argv[1:],
        "micro_batches": MICRO_BATCHES, "variants": results,
        # The toolkit's step over plain Keras's, by the compiler's estimates (1.02: 2% more).
        "guard_over_keras": ratio(seconds["toolkit"], seconds["keras"]),
        "accumulating_over_keras": ratio(seconds["toolkit_accumulating"], keras_update),
        "peak_over_keras": ratio(results["toolkit"]["peak"], results["keras"]["peak"]),
        # Where the compiler gives no time: its bytes accessed (the guard's work is a read of
        # every gradient and a select per weight, bound by memory) and FLOPs, one micro-batch's
        # under accumulation (a loop's body counts once).
        "bytes_over_keras": ratio(results["toolkit"]["bytes_accessed_per_device"],
                                  results["keras"]["bytes_accessed_per_device"]),
        "flops_over_keras": ratio(results["toolkit"]["flops_per_device"],
                                  results["keras"]["flops_per_device"]),
        "accumulating_peak_over_keras": ratio(results["toolkit_accumulating"]["peak"],
                                              results["keras_accumulating"]["peak"]),
        "accumulating_bytes_over_keras": ratio(
            results["toolkit_accumulating"]["bytes_accessed_per_device"],
            results["keras_accumulating"]["bytes_accessed_per_device"]),
        # Where the accumulating step's extra peak goes, in bytes per device.
        "accumulating_peak_extra": accumulation_extra(config, results),
    }, indent=1), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 1:
        sys.argv += DEFAULT
    cli.start(main)
