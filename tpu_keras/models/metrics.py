"""The loss and metrics shared by builders.

Each reads a language model's output either as logits or, from a head that
`train.loss_chunks` splits (`models.chunked_loss`), as each token's
negative log-likelihood already: `chunked_loss.nats` tells them apart by rank.
"""

import math

import keras

from tpu_keras.models import chunked_loss


@keras.saving.register_keras_serializable(package="tpu_keras")
class TokenMeanCrossEntropy(keras.losses.Loss):
    """Keras's sparse categorical cross-entropy from logits, or the chunked head's own
    negative log-likelihoods, reduced as `token_mean_loss` says."""

    def __init__(self, reduction="mean_with_sample_weight", name="sparse_categorical_crossentropy",
                 dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)

    def call(self, y_true, y_pred):
        return chunked_loss.nats(keras.ops.cast(y_true, "int32"), y_pred)


def token_mean_loss():
    """Cross-entropy averaged over the weighted targets: the sum over them divided by the sum
    of their weights, not by every position (Keras's default). With instruction data the
    prompt's targets weigh 0, so a batch's loss is the mean over its response tokens, and the
    gradient's scale does not follow the batch's share of response tokens. Without weights
    it is the plain mean."""
    return TokenMeanCrossEntropy()


def bits_per_token(y_true, y_pred):
    """Cross-entropy in bits: for a byte-level LM this is bits per byte."""
    return chunked_loss.nats(y_true, y_pred) / math.log(2.0)


def scaled_bits_per_token(y_true, y_pred, scale=1.0):
    return bits_per_token(y_true, y_pred) * scale


def bits_per_byte(tokens_per_byte: float = 1.0):
    """Bits per byte of text: bits per token x tokens per byte, so runs with different
    tokenizers compare on one scale. 1.0 where a token is a byte (fixed byte windows);
    for packed text, the evaluated text's tokens (end-of-document ones included) per byte."""
    return keras.metrics.MeanMetricWrapper(scaled_bits_per_token, name="bits_per_byte",
                                           scale=tokens_per_byte)


def bits_per_token_metric():
    """Bits per token, for a vocabulary that is not bytes (compare runs of one tokenizer)."""
    return keras.metrics.MeanMetricWrapper(bits_per_token, name="bits_per_token")
