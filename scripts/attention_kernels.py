"""Does keras-hub's attention run as the TPU's fused kernel? Asked of the TPU compiler.

    python scripts/attention_kernels.py [--tpus=v4-8,v5litepod-8,v5p-8,v6e-8]

Run by `python scripts/benchmark.py --attention_kernels`, in a process of its
own (the jax engine must be chosen before Keras loads). For a Llama
(keras-hub's LlamaCausalLM, 2,048 tokens, 8 heads of 128) on each TPU
generation and under the toolkit's meshes (data, fsdp, fsdp x model), libtpu
compiles the toolkit's training step ahead of time twice:

- `keras`: keras-hub's attention as Keras 3 runs it on a TPU VM. Keras picks
  its TPU kernel by asking `jax.devices()`, which on this machine are CPUs,
  so for this variant the script answers it with the slice's TPU devices, as
  a TPU VM would;
- `toolkit`: the attention a run on the TPU uses (`models.splash_attention`).

Prints one JSON object: per generation and mesh, the number of fused kernel
calls (Mosaic custom calls) in each compiled program, each one's HBM peak and
temporaries per device, and the peak's ratio.
"""

from tpu_keras import lean_imports

lean_imports.install()

import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from tpu_keras.cluster import engine  # noqa: E402

engine.select("jax")

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from tpu_keras.cluster import libtpu  # noqa: E402
from tpu_keras.planning import tpu_compiler  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "configs"))
import llama_stdlib  # noqa: E402

_TPUS = flags.DEFINE_list("tpus", ["v4-8", "v5litepod-8", "v5p-8", "v6e-8"],
                          "The slices to compile for, one per TPU generation.")
BATCH_PER_REPLICA = 4


def llama():
    """llama_stdlib's model at the length where attention's memory shows: 2,048 tokens."""
    config = llama_stdlib.get_config()
    config.model.update(context_length=2048, hidden_dim=1024, num_layers=2, num_query_heads=8,
                        num_key_value_heads=8, intermediate_dim=2816)
    config.train.precision = "mixed_bfloat16"
    return config


def meshes(devices: int) -> dict:
    return {"data": {"data": devices, "fsdp": 1, "model": 1},
            "fsdp": {"data": 1, "fsdp": devices, "model": 1},
            "fsdp_x_model": {"data": 1, "fsdp": devices // 2, "model": 2}}


@contextlib.contextmanager
def seen_as_a_tpu_vm(chips):
    """`jax.devices()` answers with the slice's TPU devices, as on a TPU VM: Keras asks it
    which attention to run. Only this script's `keras` variant; the toolkit never asks."""
    ask = jax.devices
    jax.devices = lambda *args, **kwargs: list(chips)
    try:
        yield
    finally:
        jax.devices = ask


def compiled(config, tpu, mesh, attention):
    as_keras_sees_it = (seen_as_a_tpu_vm(libtpu.devices(tpu)) if attention == "keras"
                        else contextlib.nullcontext())
    with as_keras_sees_it:
        m = tpu_compiler.measure(config, tpu, mesh, BATCH_PER_REPLICA, attention=attention)
    return {"fused_kernels": m.get("fused_kernels"), "peak": m.get("peak"),
            "temporaries": m.get("temporaries"), "fits": m["fits"]}


def main(argv):
    del argv
    config = llama()  # measure works on its own copy
    rows = []
    for tpu in _TPUS.value:
        devices = len(libtpu.devices(tpu))
        for name, mesh in meshes(devices).items():
            keras_run = compiled(config, tpu, mesh, "keras")
            toolkit_run = compiled(config, tpu, mesh, "auto")
            rows.append({"tpu": tpu, "mesh": name, **{f"mesh_{k}": v for k, v in mesh.items()},
                         "keras": keras_run, "toolkit": toolkit_run,
                         "peak_ratio": round(toolkit_run["peak"] / keras_run["peak"], 3)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"compiler": tpu_compiler.name(), "jax": jax.__version__,
                      "model": dict(config.model), "batch_per_replica": BATCH_PER_REPLICA,
                      "rows": rows}, indent=2))


if __name__ == "__main__":
    app.run(main)
