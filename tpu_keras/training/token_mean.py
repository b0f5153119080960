"""One token mean over a step's whole batch, whatever splits it: replicas, hosts, micro-batches.

A language model's loss (`models.metrics.token_mean_loss`, Keras's
`mean_with_sample_weight` reduction) is the sum over the weighted targets
divided by their weights' sum. Keras takes it per replica on the tf engine,
and the toolkit per micro-batch with `train.grad_accum_steps`; averaging
those parts, a micro-batch with 3 response tokens weighed as much as one with
300. So each part's loss (and gradient) is scaled by its weights' share of
the step's (`share`): the parts then add up to the global token mean, the
mean PEFT's and TRL's trainers take over a batch. The step's weights are
summed across replicas first, one scalar all-reduce.

The loss tracker (the logged `loss`, and `val_loss`) counts each step or
evaluation batch by its weights' sum (`tracker_weight`), not by its rows,
so it is the mean over every token it covers, as the weighted metrics
(`bits_per_token`, ...) already are. Losses of any other reduction keep
Keras's arithmetic: their parts are of equal size, so the mean of their
means is the global one.
"""

import keras

WEIGHTED_MEAN = "mean_with_sample_weight"


def applies(model, sample_weight) -> bool:
    """Whether `model`'s loss is a mean over weights and the batch has weights."""
    return sample_weight is not None and getattr(model.loss, "reduction", None) == WEIGHTED_MEAN


def weight_sum(sample_weight):
    """The float32 sum of a batch's weights."""
    return keras.ops.sum(keras.ops.cast(sample_weight, "float32"))


def share(model, sample_weight, step_weight, parts: int, replicas: int = 1):
    """The factor that turns one part's loss (Keras's: its own weighted mean, divided by the
    replicas on tf) into its term of the step's token mean: its weights over the step's,
    times the replicas Keras divided by. Without a weighted mean, 1 / parts (the mean of
    equal parts)."""
    if not applies(model, sample_weight):
        return 1.0 / parts
    return keras.ops.divide_no_nan(weight_sum(sample_weight) * replicas, step_weight)


def tracker_weight(model, x, sample_weight):
    """What the loss tracker counts a batch as: its weights' sum for a weighted mean, else
    its rows (Keras's own)."""
    if applies(model, sample_weight):
        return weight_sum(sample_weight)
    return keras.ops.shape(next(t for t in keras.tree.flatten(x) if t is not None))[0]
