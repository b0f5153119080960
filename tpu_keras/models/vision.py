"""Small image classifiers: `mlp` and `cnn` (sized for 8x8 digits, fine for mnist)."""

import keras
from keras import layers

from tpu_keras.models.registry import register


def _classification(name):
    return register(
        name,
        loss=lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=lambda: [keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        headline="accuracy")


@_classification("mlp")
def mlp(image_shape=(8, 8, 1), num_classes=10, width=256, depth=2, dropout=0.1):
    images = keras.Input(tuple(image_shape), name="images")
    x = layers.Flatten()(images)
    for i in range(depth):
        x = layers.Dense(width, activation="relu", name=f"dense{i}")(x)
        x = layers.Dropout(dropout)(x)
    logits = layers.Dense(num_classes, name="head", dtype="float32")(x)
    return keras.Model(images, logits, name="mlp")


@_classification("cnn")
def cnn(image_shape=(8, 8, 1), num_classes=10, channels=(32, 64), width=128, dropout=0.1):
    images = keras.Input(tuple(image_shape), name="images")
    x = images
    for i, c in enumerate(channels):
        x = layers.Conv2D(c, 3, padding="same", activation="relu", name=f"conv{i}")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(width, activation="relu", name="dense")(x)
    x = layers.Dropout(dropout)(x)
    logits = layers.Dense(num_classes, name="head", dtype="float32")(x)
    return keras.Model(images, logits, name="cnn")
