"""LoRA as PEFT defines it (`tpu_keras.models.lora`), on one engine, against merged kernels.

    python tests/helpers/lora_probe.py ENGINE [mesh]

For the `gpt` builder and keras-hub's Gemma (whose query kernel puts its heads
first), each with LoRA rank 2 on every projection ('all-linear') and the B
factors set at random: the trainable weights are the factors alone, as many
as PEFT counts (r x (in_features + out_features) per projection); the
logits equal those of the same model without LoRA whose kernels hold
`kernel + lora.delta(layer)` (merged, as the exports write them); with the
adapters switched off (DPO's reference), those of the base; and the factors'
gradients (LoRA writes its backward pass out) are those the chain rule gives
from the merged model's kernel gradients, dA = s G B' and dB = s A' G (G the
kernel's gradient as an in x out matrix). With `mesh`
(jax, 4 devices: data 2 x model 2), the gpt is built as a run builds it,
and each factor is split along its kernel's split axis.

Without `mesh`, also a keras-hub Llama 3 with LoRA under mixed_bfloat16, built as a
run builds it from a transformers checkpoint in bfloat16 (and one in float32),
against the same model without LoRA (float32 weights, cast to bfloat16 for
compute): the dtypes of its frozen weights, factors and optimizer slots, its
weights' bytes, its logits and loss before any step, and its export's copy
(float32, the update merged). Prints one line, `LORA {json}`.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from tpu_keras.cluster import engine  # noqa: E402

engine_name = sys.argv[1]
on_mesh = len(sys.argv) > 2 and sys.argv[2] == "mesh"
engine.select(engine_name, 4 if on_mesh else 0)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras import models  # noqa: E402
from tpu_keras.config import defaults  # noqa: E402
from tpu_keras.models import export, families, gpt, lora  # noqa: E402
from tpu_keras.training import optimization, setup  # noqa: E402

import hf_checkpoints  # noqa: E402  (beside this script: its folder is sys.path[0])

rng = np.random.default_rng(0)
keras.utils.set_random_seed(0)
GPT = dict(vocab_size=64, context_length=16, width=32, depth=2, num_heads=4, mlp_ratio=4)
GEMMA = dict(vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=2,
             hidden_dim=32, intermediate_dim=48, head_dim=8)


def peft_count(model, targets):
    """PEFT's trainable count: r x (in_features + out_features) of each adapted projection."""
    return sum(2 * (a.in_features + a.out_features) for a in
               (layer._tpu_keras_lora for layer in lora.adapted_layers(model)))


def gradients(model, call_inputs, weights):
    """{path: gradient} of sum(logits * weights) over `model`'s trainable weights."""
    if engine_name == "tf":
        import tensorflow as tf
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(model(call_inputs), "float32") * weights)
        found = tape.gradient(loss, [v.value for v in model.trainable_variables])
    else:
        import jax
        import jax.numpy as jnp
        fixed = [v.value for v in model.non_trainable_variables]

        def loss(trainable):
            out, _ = model.stateless_call(trainable, fixed, call_inputs)
            return jnp.sum(out.astype("float32") * weights)
        found = jax.grad(loss)([v.value for v in model.trainable_variables])
    return {v.path: np.asarray(keras.ops.convert_to_numpy(g), "float64")
            for v, g in zip(model.trainable_variables, found)}


def factor_gradients_from_merged(adapted, merged_gradients):
    """{factor path: gradient} the chain rule gives from the merged kernels' gradients."""
    made = {}
    for layer in lora.adapted_layers(adapted):
        adapter = layer._tpu_keras_lora
        g = np.transpose(merged_gradients[layer._kernel.path], adapter.inputs + adapter.outputs)
        g = g.reshape(adapter.in_features, adapter.out_features)
        a, b = lora.peft_matrices(layer)  # (r, in), (out, r)
        s = adapter.settings.scaling
        made[layer.lora_a.path] = (s * g @ b).reshape(layer.lora_a.shape)
        made[layer.lora_b.path] = (s * a @ g).reshape(layer.lora_b.shape)
    return made


def checks(adapted, plain, call, targets, call_inputs):
    """`adapted` (LoRA, B at random) against `plain` holding its merged kernels."""
    for layer in lora.adapted_layers(adapted):
        layer.lora_b.assign(rng.normal(0, 0.1, layer.lora_b.shape).astype("float32"))
    bases = {w.path: keras.ops.convert_to_numpy(w) for w in adapted.weights if not lora.is_factor(w.path)}
    for w in plain.weights:
        w.assign(bases[w.path])
    base = call(plain)
    for layer in lora.adapted_layers(adapted):
        kernel = next(w for w in plain.weights if w.path == layer._kernel.path)
        kernel.assign(bases[kernel.path] + lora.delta(layer))
    with lora.switched_off(lora.adapted_layers(adapted)):
        off = call(adapted)
    got = call(adapted)
    weights = rng.normal(0, 1, got.shape).astype("float32")
    own = gradients(adapted, call_inputs, weights)
    expected = factor_gradients_from_merged(adapted, gradients(plain, call_inputs, weights))
    scale = max(float(np.max(np.abs(g))) for g in expected.values())
    return {"gradients": float(max(np.max(np.abs(own[k] - expected[k])) for k in expected)) / scale,
            "trainable": int(sum(np.prod(w.shape) for w in adapted.trainable_weights)),
            "trainable_are_factors": all(lora.is_factor(w.path) for w in adapted.trainable_weights),
            "peft_count": peft_count(adapted, targets),
            "adapted": len(lora.adapted_layers(adapted)),
            "merged": float(np.max(np.abs(got - call(plain)))),
            "moved": float(np.max(np.abs(got - base))),
            "off_is_base": float(np.max(np.abs(off - base)))}


def nbytes(weights) -> int:
    return sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in weights)


def llama(preset, **lora_keys):
    """The run's model of the transformers checkpoint `preset` (`models.registry`), and its loss."""
    builder, kwargs = models.registry.get(dict(name="keras_hub:Llama3CausalLM", preset=preset,
                                               context_length=16, **lora_keys))
    return builder.make(**kwargs), builder.loss()


def step_zero(model, loss):
    """(float32 logits, the loss at step 0) of `model` on `tokens`, next-token targets."""
    logits = model(tokens)
    value = loss(np.roll(tokens, -1, axis=1), logits)
    return as_numpy(logits).astype("float64"), float(as_numpy(value))


def bfloat16_base(folder, stored):
    """A LoRA Llama 3 (rank 2, every projection) under mixed_bfloat16 from a checkpoint `stored`
    in 'bfloat16' or 'float32', against the same model without LoRA."""
    preset = os.path.join(folder, stored)
    hf_checkpoints.write(preset, "llama", dtype=stored)
    adapted, loss = llama(preset, lora_rank=2, lora_targets="all-linear")
    full, _ = llama(preset)
    (logits, value), (expected, expected_value) = step_zero(adapted, loss), step_zero(full, loss)
    optimizer = optimization.make_optimizer(defaults().train)
    optimizer.build(adapted.trainable_variables)
    checks = {"frozen": sorted({str(w.dtype) for w in adapted.non_trainable_weights}),
              "factors": sorted({str(w.dtype) for w in adapted.trainable_weights}),
              "factors_alone_train": all(lora.is_factor(w.path) for w in adapted.trainable_weights),
              "slots": sorted({str(v.dtype) for v in optimizer.variables if len(v.shape)}),
              "frozen_bytes": nbytes(adapted.non_trainable_weights), "full_bytes": nbytes(full.weights),
              "logits": float(np.max(np.abs(logits - expected))), "scale": float(np.max(np.abs(expected))),
              "loss": [value, expected_value]}
    if stored == "float32":  # the head's table rounded to bfloat16, as the adapted model stores it
        for w in full.weights:
            if w.path.startswith("token_embedding/"):
                w.assign(keras.ops.cast(keras.ops.cast(w, "bfloat16"), "float32"))
        checks["logits_head_rounded"] = float(np.max(np.abs(logits - step_zero(full, loss)[0])))
    else:
        checks["export"] = exported(adapted)
    return checks


def exported(adapted):
    """The exports' host copy of `adapted` (B set at random): its dtypes, and its kernels
    against the frozen base read in float32 plus `lora.delta`."""
    task = export.find_task(adapted)
    layers = lora.adapted_layers(task.backbone)
    for layer in layers:
        layer.lora_b.assign(rng.normal(0, 0.1, layer.lora_b.shape).astype("float32"))
    host = export.host_copy(task)
    kernels = {w.path: w for w in host.backbone.weights}
    merged = [np.max(np.abs(keras.ops.convert_to_numpy(kernels[layer._kernel.path])
                            - (keras.ops.convert_to_numpy(layer._kernel).astype("float32")
                               + lora.delta(layer)))) for layer in layers]
    return {"dtypes": sorted({str(w.dtype) for w in host.weights}), "merged": float(max(merged))}


result = {}
tokens = rng.integers(0, 64, (2, 16)).astype("int32")
as_numpy = lambda value: keras.ops.convert_to_numpy(keras.ops.cast(value, "float32"))
if not on_mesh:
    result["gpt"] = checks(gpt.gpt(**GPT, lora_rank=2, lora_targets="all-linear"), gpt.gpt(**GPT),
                           lambda m: as_numpy(m(tokens)), "all-linear", tokens)
    inputs = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    adapted = keras_hub.models.GemmaBackbone(**GEMMA)
    settings = lora.settings({"lora_rank": 2, "lora_targets": "all-linear"},
                             families.of_backbone(type(adapted)).lora_targets, (), "gemma")
    lora.attach(adapted, families.of_backbone(type(adapted)).lora_targets, settings)
    result["gemma"] = checks(adapted, keras_hub.models.GemmaBackbone(**GEMMA),
                             lambda m: as_numpy(m(inputs)), "all-linear", inputs)
    keras.config.set_dtype_policy("mixed_bfloat16")
    with tempfile.TemporaryDirectory() as folder:
        result["bfloat16_base"] = {stored: bfloat16_base(folder, stored)
                                   for stored in ("bfloat16", "float32")}
    keras.config.set_dtype_policy("float32")
else:
    config = defaults()
    config.engine = "jax"
    config.model = dict(name="gpt", **GPT, lora_rank=2, lora_targets="all-linear")
    config.mesh = dict(data=2, fsdp=1, model=2)
    cluster = tpu_keras.connect(config.cluster, engine="jax", mesh=config.mesh)
    model = setup.build_model(config, cluster)
    result["specs"] = {w.path: [a if isinstance(a, str) else None for a in w.value.sharding.spec]
                       for w in model.weights if lora.is_factor(w.path) and w.path.startswith("block0")}
print("LORA " + json.dumps(result), flush=True)
