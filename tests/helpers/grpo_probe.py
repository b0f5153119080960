"""GRPO's objective (`tpu_keras.models.grpo`) on a fixed batch of samples, on the jax engine:
prints `GRPO {json}` with the advantages, each loss type's loss, the mean KL and clip
fraction, and the loss's gradient with respect to the policy's log-probabilities.

    python tests/helpers/grpo_probe.py BATCH.npz

BATCH.npz holds rewards [rows], logp, old, ref and mask [rows, L], group_size, epsilons,
beta and max_new_tokens.
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tpu_keras.models import grpo  # noqa: E402

batch = dict(np.load(sys.argv[1]))
group, low, high = int(batch["group_size"]), float(batch["epsilon_low"]), float(batch["epsilon_high"])
beta, longest = float(batch["beta"]), int(batch["max_new_tokens"])
report = {}
for scale in (True, False):
    advantage = grpo.advantages(batch["rewards"], group, scale=scale)
    report[f"advantages_scaled_{scale}"] = np.asarray(advantage).tolist()


def loss(logp, loss_type, beta=beta, scale=True):
    advantage = grpo.advantages(batch["rewards"], group, scale=scale)
    ref = None if beta == 0 else batch["ref"]
    per_token, _, _ = grpo.per_token(logp, batch["old"], ref, advantage, low, high, beta)
    return grpo.reduce(per_token, batch["mask"], loss_type, longest)


for loss_type in grpo.LOSS_TYPES:
    report[f"loss_{loss_type}"] = float(loss(batch["logp"], loss_type))
    report[f"grad_{loss_type}"] = np.asarray(jax.grad(loss)(batch["logp"], loss_type)).tolist()
report["grad_no_kl"] = np.asarray(jax.grad(loss)(batch["logp"], "dapo", 0.0)).tolist()
report["loss_dr_grpo_unscaled"] = float(loss(batch["logp"], "dr_grpo", beta, False))
_, kl, clipped = grpo.per_token(batch["logp"], batch["old"], batch["ref"],
                                grpo.advantages(batch["rewards"], group), low, high, beta)
report["kl"] = float(grpo.token_mean(kl, batch["mask"]))
report["clip_fraction"] = float(grpo.token_mean(clipped, batch["mask"]))
print("GRPO " + json.dumps(report), flush=True)
