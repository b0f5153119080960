"""GRPO's objective (Shao et al. 2024, DeepSeekMath) as TRL's `GRPOTrainer` computes it.

For each prompt the policy samples a group of G completions, and a program
scores each one (a reward). GRPO needs no value model: a completion's
advantage is its reward against its own group's,

    advantage = (reward - group mean) / (group std + 1e-4)

with the std over the group's G rewards, unbiased (torch's `std`, which TRL
takes); Dr.GRPO (Liu et al. 2025) leaves the division out (`scale=False`),
since it weighs a group by how alike its rewards are. A group whose rewards
are all equal has advantages of 0: it teaches nothing.

Per completion token, with the policy's log-probability `logp`, the
sampling policy's `old` (the same weights on the first optimisation step of
a batch of samples, earlier ones after it: `grpo_iterations`) and the
reference's `ref`:

    ratio     = exp(logp - old)
    objective = min(ratio * advantage, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantage)
    kl        = exp(ref - logp) - (ref - logp) - 1       (Schulman's k3 estimator, >= 0)
    loss      = -objective + beta * kl

`clipped` marks the tokens where the clip is what holds the objective (the
ratio past the range in the direction the advantage pushes): their mean is
TRL's `clip_ratio/region_mean`. The loss counts completion tokens alone (the
mask: a prompt's tokens weigh exactly 0), reduced as TRL's `loss_type` says:

- `dapo` (TRL's default): the sum over every completion token of the batch
  over their count, one token mean, as the toolkit's other losses are;
- `grpo`: each completion's token mean, then the mean over completions (a
  long completion's tokens weigh less);
- `dr_grpo`: the sum over the batch's tokens over rows x max_new_tokens, a
  constant.

Everything is `keras.ops` on arrays, so both engines and a mesh run it.
`GroupModel` gives a language model's per-token log-probabilities of sampled
completions, the policy's and the reference's, and `GRPOLoss` is the `dapo`
loss over them as a Keras loss with the completion mask as its sample
weight: the toolkit's steps then take one token mean over replicas, hosts
and micro-batches (`training.token_mean`), as for its other losses. The
reference is DPO's (`models.preference`): with LoRA the base, the adapters
switched off for a second forward pass, so no second copy of the weights;
for a full fine-tune a frozen copy; none when beta is 0.
"""

import keras

from tpu_keras.models import lora

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
STD_EPSILON = 1e-4  # TRL's, added to the group's std


def advantages(rewards, group_size: int, scale: bool = True):
    """[rows] rewards, each prompt's `group_size` completions next to each other -> [rows]."""
    grouped = keras.ops.reshape(keras.ops.cast(rewards, "float32"), (-1, group_size))
    centered = grouped - keras.ops.mean(grouped, axis=1, keepdims=True)
    if scale:
        variance = keras.ops.sum(centered * centered, axis=1, keepdims=True) / (group_size - 1)
        centered = centered / (keras.ops.sqrt(variance) + STD_EPSILON)
    return keras.ops.reshape(centered, (-1,))


def per_token(logp, old, ref, advantage, epsilon_low: float, epsilon_high: float, beta: float):
    """(loss, kl, clipped) per token, each [rows, L], of [rows, L] log-probabilities and
    [rows] advantages; `ref` is None where beta is 0 (no reference is held)."""
    advantage = keras.ops.expand_dims(advantage, -1)
    ratio = keras.ops.exp(logp - old)
    bounded = keras.ops.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -keras.ops.minimum(ratio * advantage, bounded * advantage)
    if ref is None:
        kl = keras.ops.zeros_like(logp)
    else:
        gap = ref - logp
        kl = keras.ops.exp(gap) - gap - 1.0
        loss = loss + beta * kl
    clipped = keras.ops.logical_or(
        keras.ops.logical_and(ratio < 1.0 - epsilon_low, advantage < 0),
        keras.ops.logical_and(ratio > 1.0 + epsilon_high, advantage > 0))
    return loss, kl, clipped


def reduce(values, mask, loss_type: str, max_new_tokens: int):
    """The loss of [rows, L] per-token `values` over the completion tokens `mask` weighs 1."""
    mask = keras.ops.cast(mask, "float32")
    total = keras.ops.sum(values * mask)
    if loss_type == "dapo":
        return keras.ops.divide_no_nan(total, keras.ops.sum(mask))
    if loss_type == "grpo":
        each = keras.ops.sum(values * mask, axis=1) / keras.ops.maximum(keras.ops.sum(mask, axis=1), 1.0)
        return keras.ops.mean(each)
    if loss_type == "dr_grpo":
        return total / keras.ops.cast(keras.ops.shape(values)[0] * max_new_tokens, "float32")
    raise ValueError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")


def token_mean(values, mask):
    """The mean of [rows, L] `values` over the completion tokens: what the KL and clip
    fraction log as."""
    mask = keras.ops.cast(mask, "float32")
    return keras.ops.divide_no_nan(keras.ops.sum(keras.ops.cast(values, "float32") * mask),
                                   keras.ops.sum(mask))


class GroupModel(keras.Model):
    """Per-token log-probabilities of sampled sequences (token ids [rows, L + 1] in): [rows, L, 2]
    (policy, reference), or [rows, L, 1] without a reference (beta 0). `reference`, for a
    policy without LoRA layers, is a frozen copy of its starting weights."""

    def __init__(self, policy, reference=None, with_reference: bool = True, **kwargs):
        super().__init__(name=kwargs.pop("name", f"{policy.name}_group"), **kwargs)
        self.policy, self.with_reference = policy, with_reference
        self.adapters = lora.adapted_layers(policy)
        if with_reference and not self.adapters and reference is None:
            raise ValueError("a policy without LoRA layers needs a reference copy")
        self.reference = None if self.adapters or not with_reference else reference
        if self.reference is not None:
            self.reference.trainable = False
        self.built = True

    def call(self, tokens, training=None):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        policy = log_probs(self.policy(inputs, training=training), targets)
        if not self.with_reference:
            return keras.ops.expand_dims(policy, -1)
        if self.reference is not None:
            reference = log_probs(self.reference(inputs, training=False), targets)
        else:
            with lora.switched_off(self.adapters):
                reference = log_probs(self.policy(inputs, training=False), targets)
        return keras.ops.stack([policy, keras.ops.stop_gradient(reference)], axis=-1)

    def compute_output_spec(self, tokens, training=None):
        return keras.KerasTensor((tokens.shape[0], tokens.shape[1] - 1, 1 + self.with_reference),
                                 "float32")


def log_probs(logits, targets):
    """[rows, L] log-probabilities of `targets` under `logits` [rows, L, vocabulary]."""
    return -keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True)


class GRPOLoss(keras.losses.Loss):
    """The `dapo` loss of `GroupModel`'s output (with its reference when beta > 0). `y_true`
    [rows, L, 2] holds, on every token, the sampling policy's log-probability and the
    completion's advantage; the sample weight is the completion mask, so Keras's weighted
    mean is the token mean."""

    def __init__(self, epsilon_low: float = 0.2, epsilon_high: float = 0.2, beta: float = 0.0,
                 name="grpo_loss"):
        super().__init__(name=name, reduction="mean_with_sample_weight")
        self.epsilon_low, self.epsilon_high, self.beta = epsilon_low, epsilon_high, beta

    def call(self, y_true, y_pred):
        reference = y_pred[..., 1] if self.beta else None
        loss, _, _ = per_token(y_pred[..., 0], y_true[..., 0], reference, y_true[:, 0, 1],
                               self.epsilon_low, self.epsilon_high, self.beta)
        return loss

    def get_config(self):
        return {"epsilon_low": self.epsilon_low, "epsilon_high": self.epsilon_high,
                "beta": self.beta, "name": self.name}
