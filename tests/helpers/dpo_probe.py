"""DPO's scores, loss and rewards on one engine against numpy.

    python tests/helpers/dpo_probe.py ENGINE DATA_DIR WORKDIR [MESH] [full] [int8]

configs/preference_stdlib.py:tiny, set up as a run sets it up (`training.setup`:
its LoRA Llama wrapped in `models.preference.PairsModel`, compiled with the
DPO loss), on ENGINE; MESH 'fsdp2_model2' is a jax mesh of 4 fake devices
that splits the weights; 'full' trains every weight instead of LoRA (the
reference is then a frozen copy); 'int8' puts the LoRA over an int8 base
(`model.quantize`), which is then the reference. Eight real pairs go through the
pipeline's own preprocessor. The probe:

- evaluates them untrained (the policy is its reference: rewards 0, accuracy 0.5);
- gives every adapter random values (full: adds noise to every weight of the
  policy), evaluates again (`model.evaluate`: the engine's compiled test
  step) and reads the four scores (`model.predict`);
- computes the same from logits in numpy: the policy's as it is now, the
  reference's with the adapters' B factors set to zero (the base alone; full:
  the policy's logits before the noise), log-softmax at the targets,
  weighted by the mask, summed, DPO's loss;
- checks each mask against the pair's own tokenization: weight 0 on the start
  token and the prompt, 1 on the response and its end token, 0 on padding.

Prints one line, `DPO {json}`.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, "configs")
import preference_stdlib  # noqa: E402

engine_name, data_dir, workdir = sys.argv[1:4]
mesh = next((arg for arg in sys.argv[4:] if arg not in ("full", "int8")), "")
full = "full" in sys.argv[4:]
config = preference_stdlib.get_config("tiny")
if full:
    config.model.lora_rank = 0
if "int8" in sys.argv[4:]:  # LoRA over an int8 base: the reference is that base
    config.model.quantize = "int8"
config.engine = engine_name
config.data.data_dir = data_dir
if mesh == "fsdp2_model2":
    config.cluster.virtual_devices = 4
    config.mesh.update(data=1, fsdp=2, model=2)

from tpu_keras.training import setup  # noqa: E402

run = setup.set_up(config, workdir)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tpu_keras.data import preferences  # noqa: E402
from tpu_keras.models import lora, preference  # noqa: E402

model, resolved = run.model, run.config
beta = resolved.dpo.beta
path = sorted(preferences.open_source(resolved.data, training=False).files, key=lambda f: f.path)[0].path
with open(path) as file:
    records = [json.loads(next(file)) for _ in range(8)]
block = {key: tf.constant([r[key] for r in records]) for key in ("prompt", "chosen", "rejected")}
x, y = tf.function(preferences.preprocessor(resolved.data))(block)  # as tf.data runs it
x = {key: value.numpy() for key, value in x.items()}
y = y.numpy()
tokens, mask = x["tokens"], x["mask"]
length = tokens.shape[-1]

# The masks, against each pair's own tokenization.
tokenizer = preferences.make_tokenizer(resolved.data)
tokenize = tf.function(tokenizer.tokenize)
start = preferences.recipe(resolved.data).prompt_start(tokenizer)
masks_exact = True
for row, record in enumerate(records):
    prompt = len(start) + len(tokenize(tf.constant([record["prompt"]]))[0])
    for column, key in enumerate(("chosen", "rejected")):
        response = len(tokenize(tf.constant([record[key]]))[0]) + 1
        expected = np.array(([0.0] * prompt + [1.0] * response + [0.0] * length)[:length])
        masks_exact &= bool(np.array_equal(mask[row, column], expected))

flat_tokens = tokens.reshape(-1, length)
inputs, targets = flat_tokens[:, :-1], flat_tokens[:, 1:]
untrained = model.evaluate(x, y, batch_size=8, return_dict=True, verbose=0)
starting_logits = model.policy.predict(inputs, batch_size=16, verbose=0)
adapters = lora.adapted_layers(model.policy)
rng = np.random.default_rng(0)
for layer in adapters:
    for variable in (layer.lora_a, layer.lora_b):
        variable.assign(rng.normal(0, 1.0, variable.shape).astype("float32"))
if full:
    for variable in model.policy.trainable_variables:
        noise = rng.normal(0, 0.05, variable.shape).astype("float32")
        variable.assign(keras.ops.convert_to_numpy(variable.value) + noise)
evaluated = model.evaluate(x, y, batch_size=8, return_dict=True, verbose=0)
scores = model.predict(x, batch_size=8, verbose=0)

weights = mask.reshape(-1, length)[:, 1:].astype("float64")


def summed_log_probs(logits):
    logits = logits.astype("float64")
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    return (picked * weights).sum(-1).reshape(-1, 2)  # [pairs, (chosen, rejected)]


policy = summed_log_probs(model.policy.predict(inputs, batch_size=16, verbose=0))
for layer in adapters:
    layer.lora_b.assign(np.zeros(layer.lora_b.shape, "float32"))
reference = summed_log_probs(starting_logits if full else
                             model.policy.predict(inputs, batch_size=16, verbose=0))
chosen = beta * (policy[:, 0] - reference[:, 0])
rejected = beta * (policy[:, 1] - reference[:, 1])
numpy = {"loss": np.mean(np.log1p(np.exp(-(chosen - rejected)))),
         "reward_chosen": chosen.mean(), "reward_rejected": rejected.mean(),
         "reward_margin": (chosen - rejected).mean(),
         "reward_accuracy": np.mean((chosen > rejected) + 0.5 * (chosen == rejected))}
expected_scores = np.concatenate([policy, reference], axis=1)
print("DPO " + json.dumps({
    "engine": engine_name, "mesh": mesh, "devices": len(keras.distribution.list_devices()),
    "untrained": untrained, "evaluated": evaluated, "numpy": {k: float(v) for k, v in numpy.items()},
    "largest_difference": max(abs(evaluated[k] - numpy[k]) for k in numpy),
    "score_relative_difference": float(np.max(np.abs(scores - expected_scores)
                                              / np.abs(expected_scores))),
    "masks_exact": masks_exact, "prompt_tokens": int((mask[:, :, :] == 0).sum()),
    "full": full, "weights": len(model.weights), "policy_weights": len(model.policy.weights),
    "int8_kernels": sum(w.path.endswith("/kernel") and "int8" in str(w.dtype) for w in model.weights),
    "trainable": len(model.trainable_weights),
    "policy_trainable": len(model.policy.trainable_weights),
    "split_weights": sum(not getattr(getattr(w.value, "sharding", None), "is_fully_replicated", True)
                         for w in model.weights),
    "parameters": int(model.count_params()), "policy_parameters": int(model.policy.count_params()),
}), flush=True)
os._exit(0)  # what JAX's and TensorFlow's teardown would add is not the probe's
