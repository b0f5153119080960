"""The optimizer (warmup then cosine decay) and how the toolkit compiles a model.

Shared by the run, the benchmark and the layout report, so all three see
the same optimizer and the same optimizer state.
"""

import keras

from tpu_keras.errors import UserError, closest
from tpu_keras.training import auto_values, distributed_steps


def compile_model(model, builder, train_cfg, cluster, optimizer=None):
    """Compiles `model` as a run does: the configured optimizer (its variables built, so
    a checkpoint can fill them), the builder's loss and metrics, and the toolkit's steps.

    `optimizer`: one `make_optimizer(train_cfg)` made already (the TPU compiler's
    check makes it before the slice's distribution is set: `planning.compiled_step`)."""
    distributed_steps(model, train_cfg.get("grad_accum_steps", 1))
    with cluster.scope():
        model.compile(optimizer=optimizer or make_optimizer(train_cfg), loss=builder.loss(),
                      # Weighted, so padded eval rows (weight 0) do not count.
                      weighted_metrics=builder.metrics(),
                      steps_per_execution=auto_values.steps_per_execution(train_cfg, cluster),
                      # The jax engine always compiles: JAX run op by op is far too slow.
                      jit_compile=train_cfg.jit_compile or cluster.engine == "jax")
        model.optimizer.build(model.trainable_variables)


def make_optimizer(train_cfg):
    """The configured optimizer with a linear warmup and a cosine decay."""
    schedule = WarmupCosineDecay(
        initial_learning_rate=0.0, warmup_target=train_cfg.learning_rate,
        warmup_steps=train_cfg.warmup_steps,
        decay_steps=max(1, train_cfg.steps - train_cfg.warmup_steps),
        alpha=train_cfg.min_learning_rate_ratio)
    kwargs = dict(learning_rate=schedule)
    if train_cfg.clipnorm:  # the global norm, the one logged as grad_norm
        kwargs["global_clipnorm"] = train_cfg.clipnorm
    if train_cfg.weight_decay and train_cfg.optimizer in ("adamw", "lion", "sgd", "adam"):
        kwargs["weight_decay"] = train_cfg.weight_decay
    try:
        return keras.optimizers.get({"class_name": train_cfg.optimizer, "config": kwargs})
    except ValueError:
        names = [name.lower() for name, value in vars(keras.optimizers).items()
                 if isinstance(value, type) and issubclass(value, keras.optimizers.Optimizer)]
        raise UserError(f"train.optimizer={train_cfg.optimizer!r} is not a keras.optimizers name"
                        f"{closest(train_cfg.optimizer.lower(), names)}; use one such as 'adamw', "
                        "'adam' or 'sgd'") from None


class WarmupCosineDecay(keras.optimizers.schedules.CosineDecay):
    """Keras's `CosineDecay` with warmup, computed without a `cond`.

    Keras's TensorFlow optimizer evaluates the schedule once per weight (for
    weight decay), and each `cond` is a pair of graphs to trace: for the
    default gpt, the schedule's conds were a third of the train step's
    tracing time. Both branches are cheap scalars, so `where` picks one.
    """

    def __call__(self, step):
        dtype = keras.ops.convert_to_tensor(self.initial_learning_rate).dtype
        warmup_steps = keras.ops.cast(self.warmup_steps, dtype)
        step = keras.ops.minimum(keras.ops.cast(step, dtype),
                                 keras.ops.cast(self.decay_steps, dtype) + warmup_steps)
        decayed = self._decay_function(step - warmup_steps, keras.ops.cast(self.decay_steps, dtype),
                                       keras.ops.cast(self.warmup_target, dtype), dtype)
        warming = self._warmup_function(step, keras.ops.maximum(warmup_steps, 1.0),
                                        keras.ops.cast(self.warmup_target, dtype),
                                        keras.ops.cast(self.initial_learning_rate, dtype))
        return keras.ops.where(step < warmup_steps, warming, decayed)
