"""`GroupModel` and `GRPOLoss` (`tpu_keras.models.grpo`) on the tiny gpt, jax engine: prints
`GROUP {json}` with how far the model's log-probabilities are from the policy's and the
base's computed directly, the Keras loss against `reduce`'s, and what each kind of
reference holds (LoRA: nothing of its own; a full fine-tune: a frozen copy; beta 0: none).
"""

import json
import os

os.environ["KERAS_BACKEND"] = "jax"

from tpu_keras.cluster import engine  # noqa: E402

engine.select("jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tpu_keras.models import gpt, grpo, lora  # noqa: E402

GPT = dict(vocab_size=64, context_length=12, width=32, depth=1, num_heads=2)
rng = np.random.default_rng(0)
keras.utils.set_random_seed(0)
tokens = rng.integers(0, 64, (8, 13)).astype("int32")
mask = np.ones((8, 12), "float32")
mask[:, :3] = 0  # the prompt
mask[::2, 9:] = 0  # completions that stopped early
policy = gpt.gpt(**GPT, lora_rank=2)
for layer in lora.adapted_layers(policy):  # B starts at 0: move it, so the policy is not the base
    layer.lora_b.assign(rng.normal(0, 0.5, layer.lora_b.shape).astype("float32"))
group = grpo.GroupModel(policy)
out = keras.ops.convert_to_numpy(group(tokens))
direct = keras.ops.convert_to_numpy(grpo.log_probs(policy(tokens[:, :-1]), tokens[:, 1:]))
with lora.switched_off(lora.adapted_layers(policy)):
    base = keras.ops.convert_to_numpy(grpo.log_probs(policy(tokens[:, :-1]), tokens[:, 1:]))
old = direct + rng.normal(0, 0.3, direct.shape).astype("float32")
advantage = np.repeat(rng.normal(size=(8, 1)), 12, axis=1).astype("float32")
y_true = np.stack([old, advantage, mask], -1)
report = {"shape": list(out.shape), "policy_gap": float(np.abs(out[..., 0] - direct).max()),
          "reference_gap": float(np.abs(out[..., 1] - base).max()),
          "policy_vs_base": float(np.abs(direct - base).max()), "loss_gaps": {}}
for beta in (0.0, 0.04):
    per_token, _, _ = grpo.per_token(out[..., 0], old, out[..., 1] if beta else None, advantage[:, 0],
                                     0.2, 0.28, beta)
    for loss_type in grpo.LOSS_TYPES:  # each through the sample weights the run gives Keras
        keras_loss = grpo.GRPOLoss(0.2, 0.28, beta, loss_type=loss_type, max_completion_length=9)(
            y_true, out, sample_weight=grpo.sample_weights(mask, loss_type))
        report["loss_gaps"][f"{loss_type}_{beta}"] = float(
            abs(keras_loss - grpo.reduce(per_token, mask, loss_type, 9)))
# One step per batch of samples: the loss takes the policy's own log-probabilities as old.
on_policy, _, _ = grpo.per_token(out[..., 0], out[..., 0], None, advantage[:, 0], 0.2, 0.28, 0.0)
report["loss_gaps"]["on_policy"] = float(abs(
    grpo.GRPOLoss(0.2, 0.28, on_policy=True)(y_true, out, sample_weight=mask)
    - grpo.reduce(on_policy, mask, "dapo", 9)))
report["lora"] = {"weights": len(group.weights), "policy_weights": len(policy.weights),
                  "trainable": len(group.trainable_weights), "factors": 2 * len(lora.adapted_layers(policy))}
full = gpt.gpt(**GPT)
copy = gpt.gpt(**GPT)
for target, source in zip(copy.weights, full.weights):
    target.assign(source)
frozen = grpo.GroupModel(full, copy)
report["full"] = {"weights": len(frozen.weights), "policy_weights": len(full.weights),
                  "trainable": len(frozen.trainable_weights)}
alone = grpo.GroupModel(full, with_reference=False)
report["no_reference"] = {"shape": list(keras.ops.shape(alone(tokens))), "weights": len(alone.weights)}
print("GROUP " + json.dumps(report), flush=True)
