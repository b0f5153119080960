"""Transformers checkpoints in, exports out, for Llama 3 and Qwen 2, on one engine and mesh.

    python tests/hf_probe.py ENGINE OUT_DIR DATA_DIR DATA,FSDP,MODEL [FAMILY:VARIANT,...]

For each family: writes a small transformers-format checkpoint
(tests/hf_checkpoints.py), builds the toolkit's model from it
(`model.preset`) and keras-hub's own `from_preset`, and compares their
logits before any step. The runs named last (`llama:lora`, `qwen2:full`)
it then trains through `tpu_keras.training.run.train`, and reloads each of DIR/export/'s formats: keras-hub from the preset, keras-hub's
transformers loader from the transformers folder, the base checkpoint plus
lora.weights.h5, and on tf transformers' own AutoModelForCausalLM where it is
installed. Qwen has no layout rules of the toolkit's: its mesh folds
`model` into `fsdp`. Prints one line, `HF {json}`: the largest absolute logit
differences, by family and check.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json
import os
import sys

engine_name, out, data_dir, mesh = sys.argv[1:5]
runs = sys.argv[5].split(",") if len(sys.argv) > 5 else []  # 'llama:lora', 'qwen2:full', ...

from tpu_keras.cluster import engine  # noqa: E402

engine.select(engine_name)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras.config import defaults  # noqa: E402
from tpu_keras.training import run  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import hf_checkpoints  # noqa: E402

TASKS = {"llama": "Llama3CausalLM", "qwen2": "QwenCausalLM"}
tokens = np.random.default_rng(0).integers(0, 256, (4, 64)).astype("int32")


def logits(task):
    value = task({"token_ids": tokens, "padding_mask": np.ones_like(tokens)})
    return keras.ops.convert_to_numpy(keras.ops.cast(value, "float32"))


def gap(a, b):
    return float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(b, "float64"))))


def read_by_transformers(folder, expected):
    """{"torch": the gap to transformers' own logits from `folder`, "versions"}; None where
    transformers and PyTorch are not installed."""
    try:
        import torch
        import transformers
    except ImportError:
        return {"torch": None}
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        torch_logits = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    return {"torch": gap(expected, torch_logits),
            "versions": f"transformers {transformers.__version__}, torch {torch.__version__}"}


def config_for(family, checkpoint, lora_rank=0):
    config = defaults()
    config.engine = engine_name
    config.data.update(name="stdlib_bytes/ctx64", preprocess="next_token", data_dir=data_dir)
    config.model = dict(name=f"keras_hub:{TASKS[family]}", preset=checkpoint, context_length=64)
    if lora_rank:
        config.model.lora_rank = lora_rank
    data, fsdp, model = (int(n) for n in mesh.split(","))
    if family == "qwen2":
        fsdp, model = fsdp * model, 1
    config.mesh = dict(data=data, fsdp=fsdp, model=model)
    config.layout.replicate_below = 256
    config.export.formats = ("keras_hub", "transformers") + (("lora",) if lora_rank else ())
    config.train.update(batch_size=8, steps=4, warmup_steps=1, learning_rate=1e-2, eval_every=100,
                        eval_steps=1, steps_per_execution=2)
    config.checkpoint.every_steps = 4
    config.log.every_steps = 2
    return config


result = {}
for family in TASKS:
    checkpoint = os.path.join(out, family, "checkpoint")
    hf_checkpoints.write(checkpoint, family)
    config = config_for(family, checkpoint)
    cluster = tpu_keras.connect(config.cluster, engine=engine_name, mesh=config.mesh)
    toolkit = run.build_model(config, cluster)
    task_cls = getattr(keras_hub.models, TASKS[family])
    reference = task_cls.from_preset(checkpoint, preprocessor=None)
    split = [w.path for w in toolkit.weights
             if engine_name == "jax" and not w.value.sharding.is_fully_replicated]
    result[family] = {"first_step": gap(keras.ops.convert_to_numpy(toolkit(tokens)), logits(reference)),
                      "split_weights": len(split)}
    for variant, rank in (("lora", 4), ("full", 0)):
        if f"{family}:{variant}" not in runs:
            continue
        workdir = os.path.join(out, family, variant)
        trained = run.train(config_for(family, checkpoint, rank), workdir).model
        expected = keras.ops.convert_to_numpy(trained(tokens))
        export = os.path.join(workdir, "export")
        checks = {"moved": gap(expected, logits(reference)),
                  "keras_hub": gap(expected, logits(task_cls.from_preset(f"{export}/keras_hub"))),
                  "transformers": gap(expected, logits(task_cls.from_preset(f"{export}/transformers"))),
                  "files": sorted(os.listdir(export))
                  + [f"keras_hub/{n}" for n in sorted(os.listdir(f"{export}/keras_hub"))]
                  + [f"transformers/{n}" for n in sorted(os.listdir(f"{export}/transformers"))]}
        if rank:
            base = task_cls.from_preset(checkpoint, preprocessor=None)
            base.backbone.load_lora_weights(f"{export}/lora.weights.h5")
            checks["base_plus_lora"] = gap(expected, logits(base))
        if engine_name == "tf":  # the test reads transformers' own logits on the tf runs
            checks.update(read_by_transformers(f"{export}/transformers", expected))
        result[family][variant] = checks
print("HF " + json.dumps(result), flush=True)
