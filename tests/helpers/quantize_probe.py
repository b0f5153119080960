"""A base quantized as it is read against one quantized once loaded, on a 2 x 2 mesh.

    python tests/helpers/quantize_probe.py OUT

Writes a small Llama 3 transformers checkpoint (`scripts/llama_checkpoint.py`,
bfloat16) and the same weights as a keras-hub preset (`save_to_preset`: its
weights are read whole, then quantized, the path of every base that is not
a transformers folder). For int8, int4 per output feature and int4 in groups
of 64 and 128 (and in groups of 64 under mixed_bfloat16, whose LoRA base is
bfloat16), the toolkit's model (a LoRA of rank 4, whose update is zero
before training) is built from each on a fsdp 2 x model 2 mesh, and the
logits on a batch compared. Then the bad input: a block size that does not
divide, a checkpoint that lacks a projection, one with a tensor this model
does not have, a truncated shard. Prints one JSON line.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402

from tpu_keras.cluster import engine  # noqa: E402

engine.select("jax", virtual_devices=4)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras.config import defaults  # noqa: E402
from tpu_keras.errors import UserError  # noqa: E402
from tpu_keras.models import hub_presets  # noqa: E402
from tpu_keras.training import setup  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import llama_checkpoint  # noqa: E402

out = sys.argv[1]
checkpoint = os.path.join(out, "transformers")
size = llama_checkpoint.write(checkpoint, "tiny", shard_mib=4)["bytes"]


def config_for(preset, mode, block=0, precision="float32"):
    config = defaults()
    config.engine = "jax"
    config.train.precision = precision
    config.model = dict(name="keras_hub:Llama3CausalLM", preset=preset, context_length=32,
                        lora_rank=4 if mode else 0, lora_targets="all-linear" if mode else "",
                        quantize=mode, quantize_block_size=block)
    config.mesh = dict(data=1, fsdp=2, model=2)
    return config


def build(config):
    cluster = tpu_keras.connect(config.cluster, engine="jax", mesh=config.mesh)
    keras.config.set_dtype_policy(config.train.precision)  # as a run sets it
    return setup.build_model(config, cluster)


def error_of(config):
    try:
        build(config)
    except UserError as error:
        return str(error)
    return None


tokens = np.random.default_rng(0).integers(0, 300, (2, 32)).astype("int32")
# The same weights as a keras-hub preset: read whole, then quantized.
float_model = build(config_for(checkpoint, ""))
keras_hub_preset = os.path.join(out, "keras_hub")
float_model.get_layer("llama3_causal_lm").backbone.save_to_preset(keras_hub_preset)
float_logits = keras.ops.convert_to_numpy(float_model(tokens))
del float_model

result = {"checkpoint_bytes": size, "cases": {}}
# The last under mixed_bfloat16, whose LoRA base is bfloat16: quantized from bfloat16 values.
for mode, block, precision in (("int8", 0, "float32"), ("int4", -1, "float32"),
                               ("int4", 64, "float32"), ("int4", 128, "float32"),
                               ("int4", 64, "mixed_bfloat16")):
    while_read = build(config_for(checkpoint, mode, block, precision))
    logits = keras.ops.convert_to_numpy(while_read(tokens))
    once_loaded = keras.ops.convert_to_numpy(
        build(config_for(keras_hub_preset, mode, block, precision))(tokens))
    quantized = [w for w in while_read.weights if w.path.endswith("/kernel") and "int8" in str(w.dtype)]
    result["cases"][f"{mode}/{block}" + ("/bf16" if precision != "float32" else "")] = {
        "identical": bool(np.array_equal(logits, once_loaded)),
        "quantized_kernels": len(quantized),
        "error": float(np.max(np.abs(logits - float_logits)) / np.max(np.abs(float_logits)))}
    del while_read

# Bad input, each one line: a block that does not divide the input features...
result["block_error"] = error_of(config_for(checkpoint, "int4", 96))
# ...a checkpoint that lacks a projection...
lacking = os.path.join(out, "lacking")
shutil.copytree(checkpoint, lacking)
with open(os.path.join(lacking, "model.safetensors.index.json")) as file:
    index = json.load(file)
del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
with open(os.path.join(lacking, "model.safetensors.index.json"), "w") as file:
    json.dump(index, file)
result["lacking_error"] = error_of(config_for(lacking, "int8"))
# ...a checkpoint with a tensor this model does not have (a Qwen 3 query norm)...
extra = os.path.join(out, "extra")
shutil.copytree(checkpoint, extra)
from safetensors.numpy import save_file  # noqa: E402
save_file({"model.layers.0.self_attn.q_norm.weight": np.ones(64, "float32")},
          os.path.join(extra, "extra.safetensors"))
index["weight_map"] = dict(json.load(open(os.path.join(checkpoint, "model.safetensors.index.json")))
                           ["weight_map"], **{"model.layers.0.self_attn.q_norm.weight": "extra.safetensors"})
with open(os.path.join(extra, "model.safetensors.index.json"), "w") as file:
    json.dump(index, file)
result["extra_error"] = error_of(config_for(extra, "int8"))
# ...and a shard cut short.
truncated = os.path.join(out, "truncated")
shutil.copytree(checkpoint, truncated)
last = sorted(name for name in os.listdir(truncated) if name.endswith(".safetensors"))[-1]
with open(os.path.join(truncated, last), "r+b") as file:
    file.truncate(os.path.getsize(os.path.join(truncated, last)) // 2)
hub_presets.saved_backbone.cache_clear()
result["truncated_error"] = error_of(config_for(truncated, "int8"))
print(json.dumps(result))
