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
completions, the policy's and the reference's, and `GRPOLoss` is the loss
over them as a Keras loss whose sample weights (`sample_weights`) make
Keras's weighted mean each loss type's reduction; for `dapo` they are the
completion mask, so the toolkit's steps take one token mean over replicas,
hosts and micro-batches (`training.token_mean`), as for its other losses.
The reference is DPO's (`models.preference.PolicyWrapper`): with LoRA the
base, the adapters switched off for a second forward pass, so no second copy
of the weights; for a full fine-tune a frozen copy; none when beta is 0.
"""

import dataclasses

import keras
import numpy as np

from tpu_keras.config import GRPO_LOSS_TYPES as LOSS_TYPES
from tpu_keras.errors import UserError
from tpu_keras.models import chunked_loss, preference

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


class GroupModel(preference.PolicyWrapper):
    """Per-token log-probabilities of sampled sequences (token ids [rows, L + 1] in): [rows, L, 2]
    (policy, reference), or [rows, L, 1] without a reference (beta 0). The logits are divided
    by the sampling `temperature` first, as TRL's are, so the ratio compares the policy with
    the distribution the completions were drawn from."""

    def __init__(self, policy, reference=None, with_reference: bool = True,
                 temperature: float = 1.0, **kwargs):
        super().__init__(policy, reference, with_reference,
                         name=kwargs.pop("name", f"{policy.name}_group"), **kwargs)
        self.temperature = temperature

    def call(self, tokens, training=None):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        score = lambda model, training: chunked_loss.log_probs(model, inputs, targets, self.temperature,
                                                               training)
        policy = score(self.policy, training)
        if not self.with_reference:
            return keras.ops.expand_dims(policy, -1)
        return keras.ops.stack([policy, self.on_reference(lambda model: score(model, False))], axis=-1)

    def compute_output_spec(self, tokens, training=None):
        return keras.KerasTensor((tokens.shape[0], tokens.shape[1] - 1, 1 + self.with_reference),
                                 "float32")

    def get_config(self):
        return {**super().get_config(), "temperature": self.temperature}


def log_probs(logits, targets):
    """[rows, L] log-probabilities of `targets` under `logits` [rows, L, vocabulary]."""
    return -keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True)


class GRPOLoss(keras.losses.Loss):
    """GRPO's loss of `GroupModel`'s output (with its reference when beta > 0), reduced as
    `loss_type` says through the sample weights (`sample_weights`). `y_true` [rows, L, 3]
    holds, on every token, the sampling policy's log-probability, the completion's
    advantage and the completion mask."""

    def __init__(self, epsilon_low: float = 0.2, epsilon_high: float = 0.2, beta: float = 0.0,
                 on_policy: bool = False, loss_type: str = "dapo", max_completion_length: int = 1,
                 name="grpo_loss"):
        super().__init__(name=name, reduction="mean_with_sample_weight")
        self.epsilon_low, self.epsilon_high, self.beta = epsilon_low, epsilon_high, beta
        self.on_policy, self.loss_type = on_policy, loss_type
        self.max_completion_length = max_completion_length

    def call(self, y_true, y_pred):
        policy = y_pred[..., 0]
        # One optimisation step per batch of samples: the sampling policy is the policy
        # itself, so its log-probabilities are the policy's, held constant (TRL skips
        # computing them too); the ratio is 1 and the gradient the policy gradient's.
        old = keras.ops.stop_gradient(policy) if self.on_policy else y_true[..., 0]
        reference = y_pred[..., 1] if self.beta else None
        loss, _, _ = per_token(policy, old, reference, y_true[:, 0, 1],
                               self.epsilon_low, self.epsilon_high, self.beta)
        if self.loss_type == "dr_grpo":  # every position weighs 1: the mean is over rows x L
            length = keras.ops.cast(keras.ops.shape(policy)[1], "float32")
            loss = loss * y_true[..., 2] * (length / self.max_completion_length)
        return loss

    def get_config(self):
        return {"epsilon_low": self.epsilon_low, "epsilon_high": self.epsilon_high,
                "beta": self.beta, "on_policy": self.on_policy, "loss_type": self.loss_type,
                "max_completion_length": self.max_completion_length, "name": self.name}


def sample_weights(mask, loss_type: str):
    """The sample weights [rows, L] (NumPy) that make Keras's weighted mean `reduce`'s
    `loss_type`: the mask (one token mean), the mask over each completion's length (each
    completion's mean, then theirs), or 1 everywhere (`GRPOLoss` scales dr_grpo's tokens)."""
    mask = np.asarray(mask, "float32")
    if loss_type == "grpo":
        return mask / np.maximum(mask.sum(axis=1, keepdims=True), 1.0)
    if loss_type == "dr_grpo":
        return np.ones_like(mask)
    return mask


def kl(y_true, y_pred):
    """The k3 KL to the reference per token."""
    del y_true
    gap = y_pred[..., 1] - y_pred[..., 0]
    return keras.ops.exp(gap) - gap - 1.0


def clip_fraction(y_true, y_pred, epsilon_low=0.2, epsilon_high=0.2, on_policy=False):
    """1 where the clip holds the objective, per token (TRL's clip_ratio/region_mean)."""
    policy = y_pred[..., 0]
    old = policy if on_policy else y_true[..., 0]
    _, _, clipped = per_token(policy, old, None, y_true[:, 0, 1], epsilon_low, epsilon_high, 0.0)
    return keras.ops.cast(clipped, "float32")


class CompletionMean(keras.metrics.Metric):
    """The mean of a per-token function over the completion tokens (`y_true`'s mask), whatever
    the loss's sample weights are."""

    def __init__(self, fn, name=None, dtype=None, **kwargs):
        super().__init__(name=name or fn.__name__, dtype=dtype)
        self.fn, self.kwargs = fn, kwargs
        self.total = self.add_variable(shape=(), initializer="zeros", dtype="float32", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", dtype="float32", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        del sample_weight
        mask = keras.ops.cast(y_true[..., 2], "float32")
        values = keras.ops.cast(self.fn(y_true, y_pred, **self.kwargs), "float32")
        self.total.assign_add(keras.ops.sum(values * mask))
        self.count.assign_add(keras.ops.sum(mask))

    def result(self):
        return keras.ops.divide_no_nan(self.total, self.count)

    def get_config(self):
        return {"name": self.name, "fn": self.fn.__name__, **self.kwargs}


def metrics(epsilon_low: float, epsilon_high: float, beta: float, on_policy: bool) -> list:
    """KL (with a reference) and the clip fraction, over the completion tokens."""
    chosen = [CompletionMean(clip_fraction, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                             on_policy=on_policy)]
    if beta:
        chosen.insert(0, CompletionMean(kl))
    return chosen


def with_grpo_loss(language_model, grpo):
    """The registry `Builder` of a language model, turned to GRPO (the `grpo` config
    section): its loss and metrics."""
    if language_model.headline not in ("bits_per_byte", "bits_per_token"):
        raise UserError("GRPO (data.prompts) trains a language model; set model.name to "
                        "'gpt' or a keras-hub causal LM such as 'keras_hub:LlamaCausalLM'")
    clip = (grpo.epsilon, grpo.epsilon_high or grpo.epsilon)
    on_policy = grpo.num_iterations == 1
    return dataclasses.replace(
        language_model, loss=lambda: GRPOLoss(*clip, grpo.beta, on_policy, grpo.loss_type,
                                               grpo.max_completion_length),
        metrics=lambda: metrics(*clip, grpo.beta, on_policy), headline="reward")
