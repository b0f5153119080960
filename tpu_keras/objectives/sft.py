"""Supervised fine-tuning (and pretraining): the model's own loss on the data, through Keras `fit`."""

from tpu_keras.objectives.objective import Objective


class SupervisedFineTuning(Objective):
    """Every `Objective` default: the builder's loss and metrics, the model as it is."""

    name = "sft"
    data_kinds = ("", "tfds", "tfrecords", "text", "instructions")


OBJECTIVE = SupervisedFineTuning()
