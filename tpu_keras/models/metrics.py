"""Metrics shared by builders."""

import math

import keras


def bits_per_token(y_true, y_pred):
    """Cross-entropy in bits: for a byte-level LM this is bits per byte."""
    nats = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    return nats / math.log(2.0)


def bits_per_byte():
    return keras.metrics.MeanMetricWrapper(bits_per_token, name="bits_per_byte")


def bits_per_token_metric():
    """Bits per token, for a vocabulary that is not bytes (compare runs of one tokenizer)."""
    return keras.metrics.MeanMetricWrapper(bits_per_token, name="bits_per_token")
