"""Turn decoded examples into the `(inputs, targets)` a model trains on.

Named here so a config can pick one with `data.preprocess`. Each works on one
example or on a batch of them alike (training maps it over whole batches,
which is several times cheaper than per example). A preprocessor is made from
the `data` config section, so generic ones can name the features they use.
"""

import tensorflow as tf

from tpu_keras.data import preferences


def next_token(config):
    """A token sequence of length L+1 -> (first L tokens, the L tokens after each), and
    per-target weights when the example carries a mask."""
    del config

    def preprocess(example):
        tokens = tf.cast(example["tokens"], tf.int32)
        if "mask" in example:  # packed text's evaluation: its last sequence is padded
            weights = tf.cast(example["mask"][..., 1:], tf.float32)
            return tokens[..., :-1], tokens[..., 1:], weights
        return tokens[..., :-1], tokens[..., 1:]
    return preprocess


def _image_classification(scale):
    def make(config):
        del config
        return lambda example: (tf.cast(example["image"], tf.float32) / scale, example["label"])
    return make


def features(config):
    """(example[data.inputs], example[data.targets]): for TFRecord files of your own."""
    return lambda example: (example[config.inputs], example[config.targets])


PREPROCESSORS = {
    "next_token": next_token,
    "digits_image": _image_classification(16.0),   # sklearn digits hold 0..16
    "image": _image_classification(255.0),          # mnist, cifar10, ...
    "features": features,
    preferences.PREPROCESSOR: preferences.preprocessor,  # DPO's pairs (data.preferences)
}
