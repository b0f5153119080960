"""Small image classifiers: `mlp` and `cnn` (sized for 8x8 digits, fine for mnist)."""

import keras
from keras import layers

from tpu_keras.parallelism import Rule, replicated
from tpu_keras.models.registry import register


def _classification(name, layout):
    return register(
        name,
        loss=lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=lambda: [keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        headline="accuracy",
        layout=layout)


def mlp_layout_rules(depth=2, **_) -> list[Rule]:
    """Hidden units split over `model`, Megatron pairs: even layers column-, odd row-parallel.

    Shapes use I the flattened image size, W width, C classes.
    """
    rules = []
    for i in range(depth):
        if i % 2 == 0:
            # dense{i}/kernel (I or W, W), dense{i}/bias (W,)
            rules += [Rule(rf"dense{i}/kernel", (None, "model")), Rule(rf"dense{i}/bias", ("model",))]
        else:
            # dense{i}/kernel (W, W), dense{i}/bias (W,)  added after the all-reduce
            rules += [Rule(rf"dense{i}/kernel", ("model", None)), replicated(rf"dense{i}/bias")]
    # head/kernel (W, C), head/bias (C,): C = 10 rarely divides the mesh
    return rules + [replicated(r"head/(kernel|bias)")]


def cnn_layout_rules(**_) -> list[Rule]:
    """Output channels of every convolution and units of the dense layer split over `model`.

    Shapes use C_in, C_out channels, P the flattened feature map, W width, N classes.
    """
    return [
        # conv{i}/kernel (3, 3, C_in, C_out), conv{i}/bias (C_out,)
        Rule(r"conv\d+/kernel", (None, None, None, "model")),
        Rule(r"conv\d+/bias", ("model",)),
        # dense/kernel (P, W), dense/bias (W,)
        Rule(r"dense/kernel", (None, "model")),
        Rule(r"dense/bias", ("model",)),
        # head/kernel (W, N), head/bias (N,)
        replicated(r"head/(kernel|bias)"),
    ]


@_classification("mlp", layout=lambda kwargs: mlp_layout_rules(**kwargs))
def mlp(image_shape=(8, 8, 1), num_classes=10, width=256, depth=2, dropout=0.1):
    """A multilayer perceptron on flattened images; returns logits of shape (batch, num_classes).

    Args:
        image_shape: tuple, default (8, 8, 1). One image's shape, without the batch.
        num_classes: int, default 10. Classes, the width of the head.
        width: int, default 256. Units of each hidden layer.
        depth: int, default 2. Hidden layers, each Dense + ReLU + Dropout.
        dropout: float, default 0.1. Dropout rate after each hidden layer.
    """
    images = keras.Input(tuple(image_shape), name="images")
    x = layers.Flatten()(images)
    for i in range(depth):
        x = layers.Dense(width, activation="relu", name=f"dense{i}")(x)
        x = layers.Dropout(dropout)(x)
    logits = layers.Dense(num_classes, name="head", dtype="float32")(x)
    return keras.Model(images, logits, name="mlp")


@_classification("cnn", layout=lambda kwargs: cnn_layout_rules(**kwargs))
def cnn(image_shape=(8, 8, 1), num_classes=10, channels=(32, 64), width=128, dropout=0.1):
    """A small convolutional classifier; returns logits of shape (batch, num_classes).

    Args:
        image_shape: tuple, default (8, 8, 1). One image's shape (height, width, channels).
        num_classes: int, default 10. Classes, the width of the head.
        channels: tuple of int, default (32, 64). Output channels of each 3x3 convolution
            ('same' padding, ReLU), in order.
        width: int, default 128. Units of the dense layer after the convolutions.
        dropout: float, default 0.1. Dropout rate before the head.
    """
    images = keras.Input(tuple(image_shape), name="images")
    x = images
    for i, c in enumerate(channels):
        x = layers.Conv2D(c, 3, padding="same", activation="relu", name=f"conv{i}")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(width, activation="relu", name="dense")(x)
    x = layers.Dropout(dropout)(x)
    logits = layers.Dense(num_classes, name="head", dtype="float32")(x)
    return keras.Model(images, logits, name="cnn")
