"""Turn one decoded TFDS example into the `(inputs, targets)` a model trains on.

Named here so a config can pick one with `data.preprocess`; each runs inside
`Dataset.map(num_parallel_calls=AUTOTUNE)`.
"""

import tensorflow as tf


def next_token(example):
    """A byte sequence of length L+1 -> (first L bytes, the L bytes after each)."""
    tokens = tf.cast(example["tokens"], tf.int32)
    return tokens[:-1], tokens[1:]


def _image_classification(scale):
    def preprocess(example):
        return tf.cast(example["image"], tf.float32) / scale, example["label"]
    return preprocess


PREPROCESSORS = {
    "next_token": next_token,
    "digits_image": _image_classification(16.0),   # sklearn digits hold 0..16
    "image": _image_classification(255.0),          # mnist, cifar10, ...
}
