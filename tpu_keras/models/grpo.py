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
"""

import keras

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
