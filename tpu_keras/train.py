"""Train a model from a config: `python -m tpu_keras.train --config=configs/x.py --workdir=DIR`.

Reads top to bottom as the run goes: config -> cluster -> model -> checkpoint
-> data -> fit -> export. Running the same command on the same workdir resumes from the
latest checkpoint.
"""

import functools
import logging as std_logging
import os
import re
import sys
import threading
import time
import traceback
import warnings

from absl import app, flags, logging
from ml_collections import config_flags

from tpu_keras import timings
from tpu_keras.errors import Preempted, UserError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/lm_stdlib.py:tiny")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json, checkpoints, TensorBoard "
                               "events and the exported SavedModel go.")
_VERBOSE = flags.DEFINE_boolean("verbose", False, "On a mistake in the config, flags or "
                                "environment, print the traceback above the one-line error.")


def train(config, workdir: str, started: float | None = None):
    """Runs (or resumes) one training run; returns the final Keras history.

    `started` (a `time.time()`) is when the run began, for its time breakdown;
    the command line passes the process's start, so imports count too.
    """
    started = time.time() if started is None else started
    from tpu_keras import config as config_lib
    from tpu_keras import engine

    # ----- config --------------------------------------------------------------
    config_lib.check(config)
    # Before Keras is imported: it reads its backend once.
    engine.select(config.engine, config.cluster.virtual_devices)
    # Imported here so that `--help` and config errors answer without loading TF.
    import keras
    import tpu_keras
    from tpu_keras import (callbacks, checkpoint, data, flops, models, nonfinite, optimization, peak,
                           performance, preemption, profiler)
    from tpu_keras import workdir as workdir_lib
    run_timings = timings.RunTimings(started)
    builder, model_kwargs = models.registry.get(config.model)
    workdir_lib.prepare(workdir)
    if threading.current_thread() is threading.main_thread():
        preemption.watch()  # from here on, SIGTERM means "save and exit 42"

    # ----- cluster -------------------------------------------------------------
    with run_timings.phase("cluster"):
        cluster = tpu_keras.connect(config.cluster, engine=config.engine, mesh=config.mesh)
    performance.resolve(config, cluster)
    if cluster.is_chief:
        workdir_lib.write_text(os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2))
    keras.utils.set_random_seed(config.seed)
    if config.deterministic and config.engine == "tf":
        import tensorflow as tf
        tf.config.experimental.enable_op_determinism()

    # ----- model ---------------------------------------------------------------
    train_cfg = config.train
    with run_timings.phase("model"):
        model = models.build(config.model, cluster, config.layout)
        optimization.compile_model(model, builder, train_cfg, cluster)
    logging.info("model: %s with %s parameters, %s, %d steps per host call%s", config.model.name,
                 f"{model.count_params():,}", train_cfg.precision, train_cfg.steps_per_execution,
                 ", XLA" if model.jit_compile else "")

    # ----- checkpoints ---------------------------------------------------------
    saver = checkpoint.open_checkpointer(workdir, model, cluster, keep=config.checkpoint.keep)
    saver.save = run_timings.timed("checkpoints", saver.save)
    saver.restore_latest = run_timings.timed("restore", saver.restore_latest)
    skipped = nonfinite.load_skipped(saver.shared_dir)

    # ----- data ----------------------------------------------------------------
    @functools.partial(run_timings.timed, "data")
    def train_data(start_step):
        """The training batches from `start_step` on: a pure function of the step."""
        return data.build(config.data, cluster, train_cfg.batch_size, training=True,
                          seed=config.seed, start_step=start_step, skip=skipped,
                          example_log=os.path.join(workdir, "example_ids", "host")
                          if config.data.log_example_ids else "")[0]
    with run_timings.phase("data"):
        eval_data, eval_steps = data.build(config.data, cluster, train_cfg.batch_size,
                                           training=False, max_eval_steps=train_cfg.eval_steps)

    # ----- fit -----------------------------------------------------------------
    import tensorflow as tf
    # What a collective raises when a peer host is gone (connection refused or
    # reset, or MultiWorkerMirroredStrategy's health check gave up on it).
    peer_errors = (tf.errors.UnavailableError, tf.errors.AbortedError,
                    tf.errors.DeadlineExceededError, tf.errors.CancelledError)
    logger = callbacks.IntervalLogger(
        total_steps=train_cfg.steps, global_batch=train_cfg.batch_size,
        tokens_per_example=builder.tokens_per_example(model_kwargs),
        flops_per_example=flops.training_flops_per_example(model),
        peak_flops=peak.peak_flops(cluster, performance.compute_dtype(train_cfg.precision)),
        summary_dir=os.path.join(workdir, "tensorboard") if cluster.is_chief else None)
    fit_timer = callbacks.FitTimer(run_timings)  # first: its batch end times the call alone
    run_callbacks = [fit_timer, logger, nonfinite.StopOnNonFinite(saver, train_cfg.steps),
                     preemption.SaveOnPreemption(saver, cluster),
                     checkpoint.SaveEvery(saver, config.checkpoint.every_steps, train_cfg.steps)]
    if config.log.profile_steps:
        run_callbacks.append(profiler.ProfileSteps(saver, *config.log.profile_steps,
                                                   logdir=os.path.join(workdir, "tensorboard")))
    while True:
        start_step = saver.restore_latest()
        if start_step == 0 and train_cfg.on_nonfinite == "restore_and_skip":
            saver.save()  # something good to go back to
        try:
            history = _fit(model, config, start_step, train_data, eval_data, eval_steps,
                           run_callbacks, fit_timer.fit_returned)
            break
        except nonfinite.NonFiniteStep as diverged:
            skipped = _skip_or_stop(diverged, skipped, train_cfg, saver, cluster)
        except peer_errors as error:
            if cluster.num_processes == 1:
                raise
            raise UserError(f"lost contact with another host after step {saver.step} "
                            f"({_peer_reason(error)}); the other hosts stop too; start every "
                            "host again with the same command to resume from the last "
                            "checkpoint") from None

    final = {k: v[-1] for k, v in history.history.items() if k.startswith("val_")}
    if final:
        headline = f"val_{builder.headline}"
        logging.info("done at step %d: %s %.4g", saver.step, headline, final.get(headline, float("nan")))
    # Equal on every host of a synchronous run: a cheap check that hosts agree.
    logging.info("weights fingerprint: %.12e", _fingerprint(model))

    # ----- export --------------------------------------------------------------
    if cluster.is_chief:
        export_dir = os.path.join(workdir, "export")
        with run_timings.phase("export"):
            model.export(export_dir, verbose=False)
        logging.info("exported SavedModel to %s", export_dir)
    logger.close()
    run_timings.finish(os.path.join(workdir, "timings.json") if cluster.is_chief else None)
    return history


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


def _skip_or_stop(diverged, skipped, train_cfg, saver, cluster):
    """Applies train.on_nonfinite: returns the batch positions to leave out, or raises."""
    from tpu_keras import nonfinite
    from tpu_keras.data.pipeline import position_of_step
    if train_cfg.on_nonfinite == "stop" or len(skipped) >= train_cfg.max_nonfinite_skips:
        limit = (f"after {len(skipped)} skipped batch(es), train.max_nonfinite_skips"
                 if train_cfg.on_nonfinite != "stop" else "train.on_nonfinite='stop'")
        last = saver.latest_saved_step()
        kept = (f"the last good checkpoint (step {last}) is kept in {saver.shared_dir}"
                if last is not None else "nothing was saved")
        raise UserError(f"{diverged} ({limit}); {kept}; lower train.learning_rate or check the "
                        "data, or set train.on_nonfinite='restore_and_skip' to leave such batches out")
    positions = [position_of_step(step - 1, skipped) for step in range(diverged.first, diverged.last + 1)]
    logging.warning("%s; going back to the last good checkpoint and leaving out batch(es) %s",
                    diverged, positions)
    skipped = sorted(skipped + positions)
    if cluster.is_chief:
        nonfinite.save_skipped(saver.shared_dir, skipped)
    return skipped


def _peer_reason(error) -> str:
    """The first line of a collective's error, without TensorFlow's function-node prefix."""
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", str(error)).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:160] if text else ''}"


def _fingerprint(model) -> float:
    """The sum of all weights, computed where they live (sharded jax arrays span hosts)."""
    import keras
    return sum(float(keras.ops.convert_to_numpy(keras.ops.sum(w.value))) for w in model.weights)


def _parse_flags(argv):
    """absl flag parsing, with config typos, bad values and broken config files turned into one line."""
    try:
        return flags.FLAGS(argv)
    except Exception as error:  # also whatever the config file's own code raised
        _exit_with(_flag_error(error, argv))


def _flag_error(error, argv) -> str:
    """The one line for a flag that absl or ml_collections refused, or a config file that failed."""
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    message = " ".join(str(text).replace("\\n", " ").split())
    if "Traceback" in message:  # an exception inside the config file's get_config
        reason = (re.findall(r"[A-Za-z]+(?:Error|Exception): (.*)", message) or [message])[-1]
        cast = re.match(r"Could not override field '(\w+)' \(reference\)\. (.*) is of original "
                        r"type <class '(\w+)'> and cannot be casted to type <class '(\w+)'>", reason)
        if cast:
            key, value, given, wanted = cast.groups()
            line = re.findall(r'File "([^"]+)", line (\d+), in get_config', str(error))
            where = f" ({line[-1][0]}, line {line[-1][1]})" if line else ""
            reason = f"{key} takes {_a(wanted)}, not the {given} {value}{where}; set it to {_a(wanted)}"
        message = f"{message.split(': ')[0]}: {reason}"
    typo = re.search(r'Did you mean "(\w+)" instead of "(\w+)"', message)
    right, wrong = typo.groups() if typo else (None, message.strip("'\" "))
    override = next((a.split("=")[0] for a in argv if a.startswith("--config.") and f".{wrong}" in a), None)
    config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")
    if typo or (override and isinstance(error, (AttributeError, KeyError))):  # an unknown key
        where = override or f"{wrong!r} ({_where(error, config_arg).rstrip(': ') or config_arg})"
        return f"unknown config key in {where} " + (
            f"(did you mean {right!r}?)" if right else "(tpu_keras.config.defaults() lists every "
            "key; model.* are the model builder's arguments)")
    if not isinstance(error, flags.Error):  # raised by the config file's code: SyntaxError, ...
        return (f"cannot load --config={config_arg}: {_where(error, config_arg)}"
                f"{type(error).__name__}: {message}")
    bad_value = re.match(r"flag --config\.([\w.]+)=(.*?): ", message)
    current = _config_value(bad_value.group(1)) if bad_value else None
    if current is not None:  # a value of the wrong type, such as --config.train.steps=abc
        key, value = bad_value.groups()
        if hasattr(current, "keys"):
            keys = ", ".join(f"--config.{key}.{k}" for k in current.keys())
            return (f"--config.{key}={value}: {key} is a section, not a value; set "
                    + (f"its keys ({keys}) or " if keys else "") + "it in a config file")
        kind = "true or false" if isinstance(current, bool) else _a(type(current).__name__)
        example = "" if isinstance(current, bool) else f" such as {current!r}"
        return f"--config.{key}={value} is not {kind}; set {key} to {kind}{example}"
    return message


def _config_value(key: str):
    """The value `key` (e.g. 'train.steps') has in the loaded config, or None."""
    try:
        value = flags.FLAGS["config"].value
        for part in key.split("."):
            value = value[part]
        return value
    except Exception:  # the config did not load, or has no such key
        return None


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


def _where(error, config_arg: str) -> str:
    """'FILE, line N: ' for an exception raised by the config file's own code, or ''."""
    path = os.path.abspath(config_arg.split(":", 1)[0])
    if isinstance(error, SyntaxError) and error.lineno:
        return ""  # its message already names the file and line
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) == path]
    return f"{config_arg.split(':', 1)[0]}, line {frames[-1].lineno}: " if frames else ""


def _own_info_only(record) -> bool:
    """Keeps the log readable: INFO lines from tpu_keras, warnings from everyone."""
    return record.levelno >= std_logging.WARNING or "tpu_keras" in record.pathname


def _exit_with(message: str, at_once: bool = False):
    """Ends the run with one `error: ...` line (after the traceback with --verbose); exit code 2."""
    if sys.exc_info()[0] is not None and _verbose():
        traceback.print_exc()
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)  # one line, always
    if at_once:
        _exit_at_once(2)
    sys.exit(2)


def _verbose() -> bool:
    """--verbose, read from the command line itself when flag parsing failed before it."""
    if flags.FLAGS.is_parsed():
        return _VERBOSE.value
    given = [a.lower() for a in sys.argv[1:] if a.lower().split("=")[0] in ("--verbose", "--noverbose")]
    return bool(given) and given[-1] in ("--verbose", "--verbose=true", "--verbose=1")


def main(argv):
    if len(argv) > 1:
        _exit_with(f"unexpected arguments {argv[1:]}")
    if _CONFIG.value is None or not _WORKDIR.value:
        _exit_with("both --config=configs/<name>.py[:variant] and --workdir=DIR are required")
    logging.set_verbosity(logging.INFO)
    logging.get_absl_handler().python_handler.addFilter(_own_info_only)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    warnings.filterwarnings("ignore", message=".*`shuffle=True` was passed.*")
    try:
        config = _CONFIG.value
        config.to_dict()  # a config file that failed to load raises here
    except OSError as error:
        reason = [line.strip() for line in str(error).splitlines() if line.strip()][-1]
        _exit_with(f"cannot load --config={flags.FLAGS['config'].serialize().split('=', 1)[-1]}: {reason}")
    try:
        train(config, _WORKDIR.value, started=timings.process_start())
    except UserError as error:
        _exit_with(str(error), at_once=True)
    except Preempted as preempted:
        print(f"preempted: {preempted}", file=sys.stderr)
        _exit_at_once(Preempted.EXIT_CODE)
    _exit_at_once(0)


def _exit_at_once(code: int):
    """Ends a run that got as far as training, without the interpreter's teardown.

    Everything the run writes is written and flushed by now; what is left to
    tear down (input iterators whose deletion can wait for up to a minute on
    the tf.data autotuner, see `data.iterator_reaper`) is not worth waiting
    for. A multi-process jax run first leaves its coordinator cleanly.
    """
    if code == 0 and "jax" in sys.modules:
        import jax
        if jax.distributed.is_initialized():
            jax.distributed.shutdown()
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
