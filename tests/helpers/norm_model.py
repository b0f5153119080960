"""A model whose loss is finite and whose gradient is NaN at one input, on every machine.

Its features are a projection `z` and the L2 norm of `z`. At an all-zero
input `z` is 0 (a product of zeros, whatever the kernel), the norm is 0 and
the loss finite, but the norm's gradient is z / |z| = 0 / 0: NaN under IEEE
arithmetic, fused or not. Registered as `norm_features` when imported.
"""

import keras

from tpu_keras.models import register


class L2Norm(keras.layers.Layer):
    def call(self, z):
        return keras.ops.sqrt(keras.ops.sum(keras.ops.square(z), axis=-1, keepdims=True))


@register("norm_features",
          loss=lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
          metrics=lambda: [keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
          headline="accuracy")
def norm_features(input_dim=4, num_classes=2):
    inputs = keras.Input((input_dim,))
    z = keras.layers.Dense(8, use_bias=False, name="project")(inputs)
    features = keras.layers.Concatenate()([z, L2Norm()(z)])
    return keras.Model(inputs, keras.layers.Dense(num_classes, name="head")(features))
