"""Metrics shared by builders."""

import math

import keras


def bits_per_token(y_true, y_pred):
    """Cross-entropy in bits: for a byte-level LM this is bits per byte."""
    nats = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    return nats / math.log(2.0)


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
