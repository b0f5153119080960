"""One training run, stage by stage: `train(config, workdir)`.

Reads top to bottom as the run goes: config -> cluster -> parallelism ->
model -> checkpoint -> data -> fit -> export. Running it again on the same
workdir resumes from the latest checkpoint. `python -m tpu_keras.train` is
its command line; a notebook or a test can call `train` directly.

Its first stages (config, cluster, model, checkpointer) are `training.setup`'s,
which evaluation, export and generate share. Keras reads its backend once,
when it is first imported, so everything that imports Keras or TensorFlow is
imported inside `train`, after `setup` has selected the engine.
"""

# Imported inside functions: Keras and TensorFlow (the engine must be selected first:
# engine.select); JAX (optional: absent on a plain install; the tf engine runs without
# JAX); NumPy (start-up time: not every caller needs it).
import functools
import os
import re
import sys
import time

from absl import logging

from tpu_keras import data_section
from tpu_keras.errors import UserError, first_line
from tpu_keras.measurement import timings
from tpu_keras.training import defaults, finish, setup


def train(config, workdir: str, started: float | None = None):
    """Runs (or resumes) one training run; returns the final Keras history (GRPO's: the last
    evaluation's figures, `training.grpo_loop`).

    `started` (a `time.time()`) is when the run began, for its time breakdown;
    the command line passes the process's start, so imports count too.
    """
    started = time.time() if started is None else started
    if logging.get_verbosity() < logging.INFO:  # a script's own call: the log is the progress
        logging.set_verbosity(logging.INFO)

    # ----- config, cluster, model, checkpointer: training.setup -------------------
    run_timings = timings.RunTimings(started)
    run = setup.set_up(config, workdir, trains=True, timings=run_timings)
    from tpu_keras import data
    from tpu_keras.measurement import flops, peak
    from tpu_keras.models import preference
    from tpu_keras.training import callbacks, checkpoint, nonfinite, preemption, profiler
    cluster, config, builder, model = run.cluster, run.config, run.builder, run.model
    checkpointer = run.checkpointer
    compile_counter, train_cfg = run.compile_counter, config.train
    logging.info("model: %s", setup.describe(model, config))
    if data_section.kind(config.data) == "prompts":  # GRPO: the policy samples inside the run
        from tpu_keras.training import grpo_loop
        evaluated = grpo_loop.train_with_grpo(run, workdir, run_timings)
        _finish_timings(run_timings, compile_counter, workdir, cluster)
        return evaluated

    # ----- checkpoints ---------------------------------------------------------
    checkpointer.save = run_timings.timed("checkpoints", checkpointer.save)
    checkpointer.restore_latest = run_timings.timed("restore", checkpointer.restore_latest)
    skipped = nonfinite.load_skipped(checkpointer.shared_dir)

    # ----- data ----------------------------------------------------------------
    # Each step reads the examples of one update: grad_accum_steps micro-batches.
    update_batch = train_cfg.batch_size * train_cfg.grad_accum_steps
    @functools.partial(run_timings.timed, "data")
    def train_data(start_step, skipped):
        """The training batches from `start_step` on, leaving out the batch positions in
        `skipped`: a pure function of the step."""
        return data.build(config.data, cluster, update_batch, training=True,
                          seed=config.seed, start_step=start_step, skip=skipped,
                          example_log=os.path.join(workdir, "example_ids", "host")
                          if config.data.log_example_ids else "")[0]
    with run_timings.phase("data"):
        eval_data, eval_steps = data.build(config.data, cluster, train_cfg.batch_size,
                                           training=False, max_eval_steps=train_cfg.eval_steps)

    # ----- fit -----------------------------------------------------------------
    policy = preference.policy_of(model)  # a DPO run's language model
    flops_per_example = flops.training_flops_per_example(policy)
    if policy is not model:  # a pair: two sequences, each also through the reference's forward
        flops_per_example = 2 * (flops_per_example + flops.forward_flops_per_example(policy))
    # Rows packed apart hold padding: throughput and MFU count the real tokens alone.
    real_share = 1.0
    if data_section.kind(config.data) in ("text", "instructions"):
        hosts = (cluster.host_index, cluster.num_processes)  # the training pipeline's own source
        real_share -= data.text.open_source(config.data, True, hosts).padding
    logger = callbacks.IntervalLogger(
        total_steps=train_cfg.steps, global_batch=update_batch,
        tokens_per_example=builder.tokens_per_example(run.model_kwargs) * real_share,
        flops_per_example=flops_per_example * real_share,
        peak_flops=peak.peak_flops(cluster, defaults.compute_dtype(train_cfg.precision)),
        summary_dir=os.path.join(workdir, "tensorboard") if cluster.is_chief else None)
    fit_timer = callbacks.FitTimer(run_timings, compile_counter)  # first: its batch end times the call alone
    run_callbacks = [fit_timer, logger, nonfinite.StopOnNonFinite(checkpointer, train_cfg.steps),
                     preemption.SaveOnPreemption(checkpointer, cluster),
                     checkpoint.SaveEvery(checkpointer, config.checkpoint.every_steps, train_cfg.steps)]
    if config.log.profile_steps:
        run_callbacks.append(profiler.ProfileSteps(checkpointer, *config.log.profile_steps,
                                                   logdir=os.path.join(workdir, "tensorboard")))
    try:
        history = _fit_to_the_end(model, config, checkpointer, cluster, train_data, eval_data, eval_steps,
                                  run_callbacks, fit_timer.fit_returned, skipped)
    except _LostPeer:
        raise  # its save in flight waits on the lost host: the run ends without it
    except BaseException:
        finish.wait_for_the_last_save(checkpointer, run_timings, failing=True)
        raise
    finish.wait_for_the_last_save(checkpointer, run_timings)

    final = {k: v[-1] for k, v in history.history.items() if k.startswith("val_")}
    if final:
        headline = f"val_{builder.headline}"
        logging.info("done at step %d: %s %.4g", checkpointer.step, headline,
                     final.get(headline, float("nan")))
    # Equal on every host of a synchronous run: a cheap check that hosts agree.
    logging.info("weights fingerprint: %.12e", finish.fingerprint(model))

    # ----- export --------------------------------------------------------------
    with run_timings.phase("export"):
        finish.export(policy, config, workdir, cluster)
    logger.close()
    _finish_timings(run_timings, compile_counter, workdir, cluster)
    return history


def _finish_timings(run_timings, compile_counter, workdir, cluster):
    run_timings.compile_cache = compile_counter.report()
    run_timings.finish(os.path.join(workdir, "timings.json") if cluster.is_chief else None)


class _LostPeer(UserError):
    """Another host is gone: the collectives (and Orbax's commit) can no longer complete."""


def _fit_to_the_end(model, config, checkpointer, cluster, train_data, eval_data, eval_steps,
                    run_callbacks, fit_returned, skipped):
    """Resumes and fits until `train.steps`, going back to the last good checkpoint after
    a NaN when `train.on_nonfinite` says so; returns the history."""
    from tpu_keras.training import nonfinite
    train_cfg = config.train
    while True:
        start_step = checkpointer.restore_latest()
        if start_step == 0 and train_cfg.on_nonfinite == "restore_and_skip":
            checkpointer.save()  # something good to go back to
        try:
            return _fit(model, config, start_step, lambda step: train_data(step, skipped),
                        eval_data, eval_steps, run_callbacks, fit_returned)
        except nonfinite.NonFiniteStep as diverged:
            skipped = _skip_or_stop(diverged, skipped, train_cfg, checkpointer, cluster)
        except Exception as error:  # pylint: disable=broad-except  # a lost host, or raised again
            if cluster.num_processes == 1 or not _lost_a_peer(error):
                raise
            raise _LostPeer(f"lost contact with another host after step {checkpointer.step} "
                            f"({_peer_reason(error)}); the other hosts stop too; start every "
                            "host again with the same command to resume from the last "
                            "checkpoint") from None


def _fit(model, config, start_step, train_data, eval_data, eval_steps, run_callbacks, fit_returned):
    """`model.fit` from `start_step` to `train.steps`, one Keras epoch per log interval.

    A run preempted mid-interval first finishes that interval in a fit of its
    own, so log lines, validations and checkpoints stay on the same steps.
    """
    train_cfg, interval = config.train, config.log.every_steps
    boundary = -(-start_step // interval) * interval

    def fit(*args, **kwargs):
        try:
            return model.fit(*args, callbacks=run_callbacks,
                             verbose=1 if sys.stdout.isatty() else 0, **kwargs)
        finally:
            fit_returned()

    history = None
    if boundary > start_step:
        validate = boundary % train_cfg.eval_every == 0
        history = fit(train_data(start_step), epochs=1, steps_per_epoch=boundary - start_step,
                      validation_data=eval_data if validate else None, validation_steps=eval_steps)
    if boundary < train_cfg.steps or history is None:
        history = fit(train_data(boundary), epochs=train_cfg.steps // interval,
                      steps_per_epoch=interval, initial_epoch=boundary // interval,
                      validation_data=eval_data, validation_steps=eval_steps,
                      validation_freq=train_cfg.eval_every // interval)
    return history


def _skip_or_stop(diverged, skipped, train_cfg, checkpointer, cluster):
    """Applies train.on_nonfinite: returns the batch positions to leave out, or raises."""
    from tpu_keras.data.pipeline import position_of_step
    from tpu_keras.training import nonfinite
    if train_cfg.on_nonfinite == "stop" or len(skipped) >= train_cfg.max_nonfinite_skips:
        limit = (f"after {len(skipped)} skipped batch(es), train.max_nonfinite_skips"
                 if train_cfg.on_nonfinite != "stop" else "train.on_nonfinite='stop'")
        last = checkpointer.latest_saved_step()
        kept = (f"the last good checkpoint (step {last}) is kept in {checkpointer.shared_dir}"
                if last is not None else "nothing was saved")
        raise UserError(f"{diverged} ({limit}); {kept}; lower train.learning_rate or check the "
                        "data, or set train.on_nonfinite='restore_and_skip' to leave such batches out")
    positions = [position_of_step(step - 1, skipped) for step in range(diverged.first, diverged.last + 1)]
    logging.warning("%s; going back to the last good checkpoint and leaving out batch(es) %s",
                    diverged, positions)
    skipped = sorted(skipped + positions)
    if cluster.is_chief:
        nonfinite.save_skipped(checkpointer.shared_dir, skipped)
    return skipped


# On jax: a collective whose connection to another process broke (XLA:CPU's Gloo), or
# the runtime saying a peer is unreachable or gone quiet.
_PEER_LOST = re.compile(r"Gloo|Connection (reset|refused)|UNAVAILABLE|DEADLINE_EXCEEDED|heartbeat")


def _lost_a_peer(error) -> bool:
    """Whether `error` says another host is gone: every TensorFlow peer error does
    (connection refused or reset, or MultiWorkerMirroredStrategy's health check gave up on
    it); of any other, one whose message says so (an OOM does not). By the message, since
    the error's type depends on who ran the collective: XLA's step raises JaxRuntimeError,
    and Orbax's barrier before a save (jax's process_allgather) a ValueError; the second,
    taken for a failure of the run's own, waited for the save in flight, which waits on the
    lost host."""
    import tensorflow as tf
    peer_errors = (tf.errors.UnavailableError, tf.errors.AbortedError,
                   tf.errors.DeadlineExceededError, tf.errors.CancelledError)
    return isinstance(error, peer_errors) or bool(_PEER_LOST.search(str(error)))


def _peer_reason(error) -> str:
    """The first line of a collective's error, without TensorFlow's function-node prefix."""
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", str(error)).strip()
    return f"{type(error).__name__}: {first_line(text, 160) if text else ''}"
