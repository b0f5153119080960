"""DPO (Rafailov et al. 2023) on preference pairs: the policy's pairs model, its loss and TRL's metrics.

A language model (`gpt` or a keras-hub causal LM: token ids in, logits out)
is wrapped in `PairsModel`, which reads a batch of pairs
(`data.preferences`: `{"tokens", "mask"}`, each [batch, 2, L + 1], row 0
the chosen response, row 1 the rejected) and returns, per pair, four sums of
log-probabilities over the response tokens (the mask's weights):

    [policy chosen, policy rejected, reference chosen, reference rejected]

The reference is the model as training started. A LoRA run (`model.lora_rank`)
computes it with the same weights, the adapters switched off for a second
forward pass (the base weights are frozen, so the base *is* the starting
model): no second copy. A full fine-tune has no frozen base, so it keeps a
frozen copy of the starting weights (`reference`), saved in the checkpoint
beside the policy's so that a resumed run scores against the same reference.
Either way the reference's gradient is stopped: the policy pass costs a
forward and a backward, the reference pass a forward.

Everything DPO needs is then a function of those four columns, so the loss
and the metrics are plain Keras ones and every step of the toolkit (both
engines, meshes, accumulation, the non-finite guard) runs them unchanged:

    reward chosen   = beta * (policy chosen - reference chosen)
    reward rejected = beta * (policy rejected - reference rejected)
    loss            = -log sigmoid(reward chosen - reward rejected)

and, as TRL logs them (`rewards/chosen`, `rewards/rejected`,
`rewards/margins`, `rewards/accuracies`): `reward_chosen`,
`reward_rejected`, `reward_margin` and `reward_accuracy`, the share of pairs
whose chosen reward is the higher, a tie counting half (so the untrained
policy, whose rewards are both 0, scores 0.5; TRL counts a tie as a miss).
"""

import dataclasses

import keras

from tpu_keras.errors import UserError
from tpu_keras.models import chunked_loss, expert_lora, lora

HEADLINE = "reward_accuracy"
COLUMNS = ("policy_chosen", "policy_rejected", "reference_chosen", "reference_rejected")


class PolicyWrapper(keras.Model):
    """A language model (`policy`: tokens [rows, L] -> logits) wrapped for an objective that
    holds it to a reference, the model as training started: with LoRA layers its base (the
    adapters switched off for a second pass: no second copy), else `reference`, a frozen
    copy of its starting weights; none when `with_reference` is False (GRPO's beta 0).
    DPO's `PairsModel` and GRPO's `GroupModel` share it."""

    def __init__(self, policy, reference=None, with_reference: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.policy, self.with_reference = policy, with_reference
        self.adapters = lora.adapted_layers(policy) + expert_lora.adapted_layers(policy)
        if with_reference and not self.adapters and reference is None:
            raise ValueError("a policy without LoRA layers needs a reference copy")
        self.reference = None if self.adapters or not with_reference else reference
        if self.reference is not None:
            self.reference.trainable = False
        self.built = True

    def on_reference(self, score):
        """`score(model)` on the reference (its gradient stopped)."""
        if self.reference is not None:
            return keras.ops.stop_gradient(score(self.reference))
        with lora.switched_off(self.adapters):
            return keras.ops.stop_gradient(score(self.policy))

    def get_config(self):
        """The policy's config and the reference's kind: what the step cache keys a step by."""
        return {"name": self.name, "policy": keras.saving.serialize_keras_object(self.policy),
                "frozen_reference": self.reference is not None,
                "with_reference": self.with_reference}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        policy = config.pop("policy")
        make = lambda: keras.saving.deserialize_keras_object(policy)
        reference = make() if config.pop("frozen_reference", False) else None
        return cls(make(), reference, **config)


class PairsModel(PolicyWrapper):
    """A language model's scores of preference pairs: [batch, 4] sums of log-probabilities
    (`COLUMNS`)."""

    def __init__(self, policy, reference=None, **kwargs):
        kwargs.pop("with_reference", None)
        super().__init__(policy, reference, name=kwargs.pop("name", f"{policy.name}_pairs"),
                         **kwargs)

    def call(self, inputs, training=None):
        tokens, mask = inputs["tokens"], keras.ops.cast(inputs["mask"], "float32")
        length = keras.ops.shape(tokens)[-1] - 1
        # [batch, 2, L + 1] -> [2 * batch, L + 1]: a pair's rows stay next to each other, so
        # a batch split over devices by rows keeps its split.
        flat = keras.ops.reshape(tokens, (-1, length + 1))
        weights = keras.ops.reshape(mask, (-1, length + 1))[:, 1:]
        inputs_, targets = flat[:, :-1], flat[:, 1:]
        policy = self._scores(self.policy, inputs_, targets, weights, training)
        reference = self.on_reference(
            lambda model: self._scores(model, inputs_, targets, weights, False))
        both = keras.ops.stack([policy, reference], axis=-1)  # [2 * batch, 2]
        # [batch, (chosen, rejected), (policy, reference)] -> COLUMNS' order
        pairs = keras.ops.reshape(both, (-1, 2, 2))
        return keras.ops.reshape(keras.ops.transpose(pairs, (0, 2, 1)), (-1, 4))

    @staticmethod
    def _scores(model, inputs, targets, weights, training):
        log_probs = chunked_loss.log_probs(model, inputs, targets, training=training)
        return keras.ops.sum(log_probs * weights, axis=-1)

    def compute_output_spec(self, inputs, training=None):
        return keras.KerasTensor((inputs["tokens"].shape[0], 4), "float32")


def policy_of(model):
    """The language model inside a `PolicyWrapper` (DPO's, GRPO's); any other model as it is."""
    return model.policy if isinstance(model, PolicyWrapper) else model


def rewards(scores, beta: float):
    """(chosen, rejected) rewards of [batch, 4] scores."""
    chosen = beta * (scores[:, 0] - scores[:, 2])
    rejected = beta * (scores[:, 1] - scores[:, 3])
    return chosen, rejected


class DPOLoss(keras.losses.Loss):
    """-log sigmoid(reward chosen - reward rejected), averaged over the weighted pairs (a
    padded evaluation row weighs 0)."""

    def __init__(self, beta: float, name="dpo_loss"):
        super().__init__(name=name, reduction="mean_with_sample_weight")
        self.beta = beta

    def call(self, y_true, y_pred):
        del y_true  # everything is in the scores
        chosen, rejected = rewards(y_pred, self.beta)
        return keras.ops.softplus(rejected - chosen)

    def get_config(self):
        return {"beta": self.beta, "name": self.name}


def reward_chosen(y_true, y_pred, beta):
    del y_true
    return rewards(y_pred, beta)[0]


def reward_rejected(y_true, y_pred, beta):
    del y_true
    return rewards(y_pred, beta)[1]


def reward_margin(y_true, y_pred, beta):
    del y_true
    chosen, rejected = rewards(y_pred, beta)
    return chosen - rejected


def reward_accuracy(y_true, y_pred, beta):
    del y_true
    chosen, rejected = rewards(y_pred, beta)
    return (keras.ops.cast(chosen > rejected, "float32")
            + 0.5 * keras.ops.cast(chosen == rejected, "float32"))


def metrics(beta: float) -> list:
    """TRL's reward metrics, weighted by pair (beta in each one's config)."""
    return [keras.metrics.MeanMetricWrapper(fn, name=fn.__name__, beta=beta)
            for fn in (reward_chosen, reward_rejected, reward_margin, reward_accuracy)]


def with_dpo_loss(language_model, beta: float):
    """The registry `Builder` of a language model, turned to DPO: its loss, its metrics,
    two sequences per example."""
    if language_model.headline not in ("bits_per_byte", "bits_per_token"):
        raise UserError("DPO (data.preferences) trains a language model; set model.name to "
                        "'gpt' or a keras-hub causal LM such as 'keras_hub:LlamaCausalLM'")
    per_sequence = language_model.tokens_per_example
    return dataclasses.replace(language_model, loss=lambda: DPOLoss(beta),
                               metrics=lambda: metrics(beta), headline=HEADLINE,
                               tokens_per_example=lambda kwargs: 2 * per_sequence(kwargs))
