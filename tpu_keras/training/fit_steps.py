"""Keras `fit` as a step source of the run's outer loop (`training.controller`): supervised
fine-tuning, DPO and any objective without a step source of its own.

`fit` runs one Keras "epoch" per log interval, from the step the run resumes
at; the controller's callbacks save, guard and profile inside it, and this
source's own, `IntervalLogger`, writes the log line with throughput and MFU.
"""

# Imported inside functions: Keras and TensorFlow (the engine must be selected first:
# engine.select).
import os
import sys

from tpu_keras import data_section


class KerasFit:
    """The training and validation data of a run, and `fit` over them."""

    def __init__(self, run, workdir: str, run_timings):
        from tpu_keras import data
        from tpu_keras.models import preference
        self.run_setup, self.workdir = run, workdir
        config, cluster, train_cfg = run.config, run.cluster, run.config.train
        # Each step reads the examples of one update: grad_accum_steps micro-batches.
        self.update_batch = train_cfg.batch_size * train_cfg.grad_accum_steps
        self._data = run_timings.timed("data", self._train_data)
        with run_timings.phase("data"):
            self.eval_data, self.eval_steps = data.build(
                config.data, cluster, train_cfg.batch_size, training=False,
                max_eval_steps=train_cfg.eval_steps)
        self.policy = preference.policy_of(run.model)  # what the run exports: DPO's language model
        self._callbacks = None

    def _train_data(self, start_step: int, skipped: list):
        """The training batches from `start_step` on, leaving out the batch positions in
        `skipped`: a pure function of the step."""
        from tpu_keras import data
        config, cluster = self.run_setup.config, self.run_setup.cluster
        return data.build(config.data, cluster, self.update_batch, training=True,
                          seed=config.seed, start_step=start_step, skip=skipped,
                          example_log=os.path.join(self.workdir, "example_ids", "host")
                          if config.data.log_example_ids else "")[0]

    def _logger(self, controller):
        """The log line's callback: throughput and MFU over the real tokens alone (rows
        packed apart hold padding)."""
        from tpu_keras import data
        from tpu_keras.measurement import peak
        from tpu_keras.training import callbacks, auto_values
        run, config = self.run_setup, self.run_setup.config
        real_share = 1.0
        if data_section.kind(config.data) in ("text", "instructions"):
            hosts = (run.cluster.host_index, run.cluster.num_processes)  # the training pipeline's own
            real_share -= data.text.open_source(config.data, True, hosts).padding
        return callbacks.IntervalLogger(
            total_steps=config.train.steps, global_batch=self.update_batch,
            tokens_per_example=run.builder.tokens_per_example(run.model_kwargs) * real_share,
            flops_per_example=run.objective.flops_per_example(run.model) * real_share,
            peak_flops=peak.peak_flops(run.cluster, auto_values.compute_dtype(config.train.precision)),
            writer=controller.writer)

    def run(self, controller, start_step: int, skipped: list):
        """`model.fit` from `start_step` to `train.steps`, one Keras epoch per log interval;
        returns (the history, its last validation).

        A run preempted mid-interval first finishes that interval in a fit of its
        own, so log lines, validations and checkpoints stay on the same steps.
        """
        if self._callbacks is None:
            self._callbacks = controller.callbacks([self._logger(controller)])
        model, train_cfg = self.run_setup.model, self.run_setup.config.train
        interval = self.run_setup.config.log.every_steps
        boundary = -(-start_step // interval) * interval

        def fit(*args, **kwargs):
            try:
                return model.fit(*args, callbacks=self._callbacks,
                                 verbose=1 if sys.stdout.isatty() else 0, **kwargs)
            finally:
                controller.fit_timer.fit_returned()

        history = None
        if boundary > start_step:
            validate = boundary % train_cfg.eval_every == 0
            history = fit(self._data(start_step, skipped), epochs=1,
                          steps_per_epoch=boundary - start_step,
                          validation_data=self.eval_data if validate else None,
                          validation_steps=self.eval_steps)
        if boundary < train_cfg.steps or history is None:
            history = fit(self._data(boundary, skipped), epochs=train_cfg.steps // interval,
                          steps_per_epoch=interval, initial_epoch=boundary // interval,
                          validation_data=self.eval_data, validation_steps=self.eval_steps,
                          validation_freq=train_cfg.eval_every // interval)
        return history, {k: v[-1] for k, v in history.history.items() if k.startswith("val_")}
