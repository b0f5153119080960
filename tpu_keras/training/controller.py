"""The outer loop of every run, as Orbit's controller is: `Controller(run, workdir, timings).run(steps)`.

A step source trains (Keras `fit` for supervised fine-tuning and DPO,
`training.fit_steps`; GRPO's sample-then-update, `objectives.grpo_steps`);
the controller owns what every run does around its steps, whatever trains:

* the checkpoints: the resume from the latest, the saves at every
  `checkpoint.every_steps` and at the end, timed, and the wait for the last
  save (on an error too, so that nothing written is lost);
* preemption (SIGTERM saves the step and exits 42), the non-finite guard's
  return (`train.on_nonfinite`: stop, or go back to the last good checkpoint
  and leave the batch out) and lost hosts (every survivor ends by itself,
  with a save in flight or not);
* profiling (`log.profile_steps`), the execution timings, the run's one
  TensorBoard writer, and the ending: the weights' fingerprint, the export,
  `timings.json`.

A step source has `run(controller, start_step, skipped)`, which trains from
`start_step` to `train.steps` and returns the run's result and its last
validation's figures; it calls the
controller's callbacks (`callbacks(own)`, Keras callbacks: `fit` calls them
itself, another source calls them as `fit` would, one "epoch" per log
interval) and logs through `log`. Its `policy` is what the run exports.
"""

# Imported inside functions: TensorFlow (start-up time: the summary writer alone needs it).
import os
import re

from absl import logging

from tpu_keras.errors import UserError, first_line
from tpu_keras.training import callbacks as callbacks_lib, checkpoint, finish, nonfinite
from tpu_keras.training import preemption, profiler


class LostPeer(UserError):
    """Another host is gone: the collectives (and Orbax's commit) can no longer complete."""


class Controller:
    """What a run does around its steps: see the module's docstring."""

    def __init__(self, run, workdir: str, run_timings):
        self.run_setup, self.workdir, self.timings = run, workdir, run_timings
        self.config, self.cluster, self.checkpointer = run.config, run.cluster, run.checkpointer
        self.checkpointer.save = run_timings.timed("checkpoints", self.checkpointer.save)
        self.checkpointer.restore_latest = run_timings.timed("restore",
                                                             self.checkpointer.restore_latest)
        self.writer = None  # the run's one TensorBoard writer, on the chief
        if self.cluster.is_chief:
            import tensorflow as tf
            self.writer = tf.summary.create_file_writer(os.path.join(workdir, "tensorboard"))
        self.fit_timer = callbacks_lib.FitTimer(run_timings, run.compile_counter)

    def callbacks(self, own=(), steps_per_boundary: int = 1) -> list:
        """The Keras callbacks of the run, around a source's `own` (its log line): the
        timer first (its batch end then times the call alone), then the guard, the
        preemption check (at steps that are multiples of `steps_per_boundary`: where a
        checkpoint may fall), the interval saves and the profile."""
        config, checkpointer = self.config, self.checkpointer
        chosen = [self.fit_timer, *own, nonfinite.StopOnNonFinite(checkpointer, config.train.steps),
                  preemption.SaveOnPreemption(checkpointer, self.cluster, steps_per_boundary),
                  checkpoint.SaveEvery(checkpointer, config.checkpoint.every_steps,
                                       config.train.steps)]
        if config.log.profile_steps:
            chosen.append(profiler.ProfileSteps(checkpointer, *config.log.profile_steps,
                                                logdir=os.path.join(self.workdir, "tensorboard")))
        return chosen

    def log(self, step: int, scalars: dict) -> None:
        """One log line at `step`, and the same scalars to TensorBoard."""
        callbacks_lib.log_scalars(step, self.config.train.steps, scalars, self.writer)

    def run(self, source):
        """Trains with `source` to `train.steps`, resuming where the run left off, and ends
        the run; returns what `source.run` returned."""
        try:
            result, figures = self._to_the_end(source)
        except Exception as error:  # pylint: disable=broad-except  # a lost host, or raised again
            if self.cluster.num_processes > 1 and lost_a_peer(error):
                # Its save in flight waits on the lost host: the run ends without it.
                raise LostPeer(f"lost contact with another host after step "
                               f"{self.checkpointer.step} ({_peer_reason(error)}); the other "
                               "hosts stop too; start every host again with the same command "
                               "to resume from the last checkpoint") from None
            finish.wait_for_the_last_save(self.checkpointer, self.timings, failing=True)
            raise
        except BaseException:  # preempted, interrupted
            finish.wait_for_the_last_save(self.checkpointer, self.timings, failing=True)
            raise
        finish.wait_for_the_last_save(self.checkpointer, self.timings)
        if figures:
            headline = f"val_{self.run_setup.builder.headline}"
            logging.info("done at step %d: %s %.4g", self.checkpointer.step, headline,
                         figures.get(headline, float("nan")))
        # Equal on every host of a synchronous run: a cheap check that hosts agree.
        logging.info("weights fingerprint: %.12e", finish.fingerprint(self.run_setup.model))
        with self.timings.phase("export"):
            finish.export(source.policy, self.config, self.workdir, self.cluster)
        if self.writer:
            self.writer.close()
        self.timings.compile_cache = self.run_setup.compile_counter.report() \
            if self.run_setup.compile_counter else None
        self.timings.finish(os.path.join(self.workdir, "timings.json")
                            if self.cluster.is_chief else None)
        return result

    def _to_the_end(self, source):
        """Resumes and trains until `train.steps`, going back to the last good checkpoint
        after a NaN when `train.on_nonfinite` says so."""
        train_cfg, checkpointer = self.config.train, self.checkpointer
        skipped = nonfinite.load_skipped(checkpointer.shared_dir)
        while True:
            start_step = checkpointer.restore_latest()
            if start_step == 0 and train_cfg.on_nonfinite == "restore_and_skip":
                checkpointer.save()  # something good to go back to
            try:
                return source.run(self, start_step, skipped)
            except nonfinite.NonFiniteStep as diverged:
                skipped = self._skip_or_stop(diverged, skipped)

    def _skip_or_stop(self, diverged, skipped):
        """Applies train.on_nonfinite: returns the batch positions to leave out, or raises."""
        from tpu_keras.data.pipeline import position_of_step
        train_cfg, checkpointer = self.config.train, self.checkpointer
        if train_cfg.on_nonfinite == "stop" or len(skipped) >= train_cfg.max_nonfinite_skips:
            limit = (f"after {len(skipped)} skipped batch(es), train.max_nonfinite_skips"
                     if train_cfg.on_nonfinite != "stop" else "train.on_nonfinite='stop'")
            last = checkpointer.latest_saved_step()
            kept = (f"the last good checkpoint (step {last}) is kept in {checkpointer.shared_dir}"
                    if last is not None else "nothing was saved")
            raise UserError(f"{diverged} ({limit}); {kept}; lower train.learning_rate or "
                            f"{self.run_setup.objective.nonfinite_hint}")
        positions = [position_of_step(step - 1, skipped)
                     for step in range(diverged.first, diverged.last + 1)]
        logging.warning("%s; going back to the last good checkpoint and leaving out batch(es) %s",
                        diverged, positions)
        skipped = sorted(skipped + positions)
        if self.cluster.is_chief:
            nonfinite.save_skipped(checkpointer.shared_dir, skipped)
        return skipped


# On jax: a collective whose connection to another process broke (XLA:CPU's Gloo), or
# the runtime saying a peer is unreachable or gone quiet.
_PEER_LOST = re.compile(r"Gloo|Connection (reset|refused)|UNAVAILABLE|DEADLINE_EXCEEDED|heartbeat")


def lost_a_peer(error) -> bool:
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
