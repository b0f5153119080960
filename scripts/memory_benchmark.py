"""A LoRA step over a Llama 3 checkpoint, over its float base and over its int8 base: the
host memory each run peaks at, against the checkpoint's bytes.

    python scripts/memory_benchmark.py [--size=0.85b] [--checkpoint=FOLDER]

Writes the checkpoint (`llama_checkpoint.py`: bfloat16 safetensors shards, as
transformers' save_pretrained lays them out) unless one is given, then runs
`python -m tpu_keras.train` twice, each in a process of its own, as a user
would: `configs/finetune.py` with `model.preset` the checkpoint, LoRA of
rank 4, 4 CPU devices split as fsdp=4, each transformer block recomputed
in the backward pass (train.remat='blocks': no device keeps every block's
gathered weights), the logits split over the vocabulary
(layout.split_logits: no device gathers the output head), a batch of
4 x 64 tokens, one step, a checkpoint and the PEFT adapter written. The second run adds
`model.quantize=int8`. Each run's own `timings.json` gives its peak
resident memory and the mark before its model was built (the libraries and
the data pipeline); the difference is what the model cost the host. Prints
one JSON object.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_checkpoint  # noqa: E402  (beside this script)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


def lora_step(checkpoint: str, workdir: str, data: str, *extra: str) -> dict:
    """One LoRA step over `checkpoint` in a process of its own; its timings and checkpoint."""
    command = [sys.executable, "-m", "tpu_keras.train", "--config=configs/finetune.py",
               f"--workdir={workdir}", f"--config.model.preset={checkpoint}",
               f"--config.data.text.files={data}", f"--config.data.text.eval_files={data}",
               "--config.cluster.virtual_devices=4", "--config.mesh.model=1", "--config.mesh.fsdp=4",
               "--config.train.batch_size=4", "--config.model.context_length=64",
               "--config.model.lora_rank=4", "--config.train.remat=blocks", "--config.train.steps=1",
               "--config.layout.split_logits=True", "--config.log.every_steps=1",
               "--config.checkpoint.every_steps=1", "--config.train.eval_every=1",
               "--config.train.eval_steps=1", "--config.export.formats=('peft',)", *extra]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(command[1:])} exited {done.returncode}:\n"
                         f"{done.stdout[-3000:]}")
    with open(os.path.join(workdir, "timings.json")) as file:
        timings = json.load(file)
    saved = os.path.join(workdir, "checkpoints")
    checkpoint_bytes = sum(os.path.getsize(os.path.join(folder, name))
                           for folder, _, names in os.walk(saved) for name in names)
    peak, before = timings["peak_host_bytes"], timings["peak_host_bytes_before"]["model"]
    return {"peak_host_gib": round(peak / GIB, 2), "before_model_gib": round(before / GIB, 2),
            "model_cost_gib": round((peak - before) / GIB, 2), "peak_host_bytes": peak,
            "model_cost_bytes": peak - before, "checkpoint_folder_bytes": checkpoint_bytes,
            "wall_seconds": round(time.perf_counter() - started, 1),
            "seconds": timings["seconds"]}


def measure(size: str, checkpoint: str = "") -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        if not checkpoint:
            checkpoint = os.path.join(scratch, "checkpoint")
            llama_checkpoint.write(checkpoint, size)
        weights = sum(os.path.getsize(os.path.join(checkpoint, name)) for name in os.listdir(checkpoint)
                      if name.endswith(".safetensors"))
        data = os.path.join(scratch, "data.jsonl")
        with open(data, "w") as file:
            for i in range(64):
                file.write(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 4}) + "\n")
        runs = {"float": lora_step(checkpoint, os.path.join(scratch, "float"), data),
                "int8": lora_step(checkpoint, os.path.join(scratch, "int8"), data,
                                  "--config.model.quantize=int8")}
    float_peak = runs["float"]["peak_host_bytes"]
    return {"size": size, "checkpoint_bytes": weights, "checkpoint_gib": round(weights / GIB, 2),
            "runs": runs,
            "float_peak_over_checkpoint": round(float_peak / weights, 2),
            "float_limit_gib": round((4 * weights + 2 * GIB) / GIB, 2),
            "int8_peak_over_float": round(runs["int8"]["peak_host_bytes"] / float_peak, 3),
            "int8_model_cost_over_float": round(runs["int8"]["model_cost_bytes"]
                                                / runs["float"]["model_cost_bytes"], 3)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.85b", choices=sorted(llama_checkpoint.SIZES))
    parser.add_argument("--checkpoint", default="", help="a Llama 3 transformers folder to use")
    arguments = parser.parse_args()
    print(json.dumps(measure(arguments.size, arguments.checkpoint), indent=2))
