"""A small classifier on scikit-learn's bundled 8x8 digits, fully offline.

    python -m tpu_keras.train --config=configs/digits.py --workdir=/tmp/digits
    python -m tpu_keras.train --config=configs/digits.py:cnn --workdir=/tmp/digits_cnn

Variants: 'mlp' (the default), 'cnn', 'resnet' (keras-hub's ResNetImageClassifier;
the 'hub' extra) and 'tiny' (a few steps, for tests).
"""

from tpu_keras.config import defaults


def get_config(arg=None):
    config = defaults()
    config.data.tfds.name = "digits"
    config.data.preprocess = "digits_image"
    config.data.tfds.eval_split = "test"
    config.data.shuffle_buffer = 2000   # the whole split: a full shuffle every epoch
    config.data.cache = True            # 1437 small images: decode once
    config.model = dict(name=arg if arg in ("mlp", "cnn") else "mlp", image_shape=(8, 8, 1),
                        num_classes=10)

    config.train.batch_size = 64
    config.train.steps = 600
    config.train.learning_rate = 3e-3
    config.train.warmup_steps = 50
    config.train.eval_every = 200
    config.checkpoint.every_steps = 200
    config.log.every_steps = 100

    if arg == "resnet":  # keras-hub's ResNet (the 'hub' extra), sized for 8x8 images
        config.model = dict(name="keras_hub:ResNetImageClassifier", num_classes=10,
                            image_shape=(8, 8, 1), input_conv_filters=(64,),
                            input_conv_kernel_sizes=(3,), stackwise_num_filters=(64, 64),
                            stackwise_num_blocks=(1, 1), stackwise_num_strides=(1, 2),
                            block_type="basic_block", use_pre_activation=True)
    if arg == "tiny":
        config.train.update(steps=20, warmup_steps=5, eval_every=10, steps_per_execution=5)
        config.checkpoint.every_steps = 10
        config.log.every_steps = 10
    elif arg not in (None, "", "mlp", "cnn", "resnet"):
        raise ValueError(f"unknown variant {arg!r} of digits; use 'mlp', 'cnn', 'resnet' or 'tiny'")
    return config
