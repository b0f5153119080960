"""What the probe scripts share: a config's model built as a run builds it, from initial
weights shared between processes, trained a few steps on the run's own batches."""

import os

import keras
import numpy as np

import tpu_keras
from tpu_keras import data
from tpu_keras.training.setup import build_model


def train_from_shared_init(config, engine: str, init_path: str, steps: int):
    """(model, history): `config`'s model on `engine`, one step per epoch for `steps` steps.

    The first process to run saves its initial weights to `init_path`; later
    ones load them, so their losses compare step by step.
    """
    model, cluster = built_from_shared_init(config, engine, init_path)
    train_data, _ = data.build(config.data, cluster, config.train.batch_size, training=True)
    return model, model.fit(train_data, steps_per_epoch=1, epochs=steps, verbose=0), cluster


def built_from_shared_init(config, engine: str, init_path: str):
    """(model, cluster): `config`'s model on `engine`, one step per execution, its initial
    weights saved to `init_path` by the first process to run and loaded by later ones."""
    config.train.steps_per_execution = 1
    cluster = tpu_keras.connect(config.cluster, engine=engine, mesh=config.mesh)
    keras.utils.set_random_seed(0)
    model = build_model(config, cluster)
    if os.path.exists(init_path):
        model.set_weights(list(np.load(init_path).values()))
    else:
        np.savez(init_path, *model.get_weights())
    return model, cluster
