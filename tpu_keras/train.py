"""Train a model from a config: `python -m tpu_keras.train --config=configs/x.py --workdir=DIR`.

Reads top to bottom as the run goes: config -> cluster -> model -> checkpoint
-> data -> fit -> export. Running the same command on the same workdir resumes from the
latest checkpoint.
"""

import logging as std_logging
import os
import re
import sys
import warnings

from absl import app, flags, logging
from ml_collections import config_flags

from tpu_keras.errors import UserError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/lm_stdlib.py:tiny")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where config.json, checkpoints, TensorBoard "
                               "events and the exported SavedModel go.")


def train(config, workdir: str):
    """Runs (or resumes) one training run; returns the final Keras history."""
    from tpu_keras import config as config_lib
    from tpu_keras import engine

    # ----- config --------------------------------------------------------------
    config_lib.check(config)
    # Before Keras is imported: it reads its backend once.
    engine.select(config.engine, config.cluster.virtual_devices)
    # Imported here so that `--help` and config errors answer without loading TF.
    import keras
    import tpu_keras
    from tpu_keras import callbacks, checkpoint, data, flops, models, optimization, peak, performance
    builder, model_kwargs = models.registry.get(config.model)
    os.makedirs(workdir, exist_ok=True)

    # ----- cluster -------------------------------------------------------------
    cluster = tpu_keras.connect(config.cluster, engine=config.engine, mesh=config.mesh)
    performance.resolve(config, cluster)
    if cluster.is_chief:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
    keras.utils.set_random_seed(config.seed)

    # ----- model ---------------------------------------------------------------
    train_cfg = config.train
    model = models.build(config.model, cluster, config.layout)
    optimization.compile_model(model, builder, train_cfg, cluster)
    logging.info("model: %s with %s parameters, %s, %d steps per host call%s", config.model.name,
                 f"{model.count_params():,}", train_cfg.precision, train_cfg.steps_per_execution,
                 ", XLA" if model.jit_compile else "")

    # ----- checkpoints ---------------------------------------------------------
    saver = checkpoint.open_checkpointer(workdir, model, cluster, keep=config.checkpoint.keep)
    start_step = saver.restore_latest()
    interval = config.log.every_steps
    if start_step % interval:
        raise UserError(f"checkpoint at step {start_step} is not on a log.every_steps={interval} "
                        "boundary; keep log.every_steps as it was when the run started")

    # ----- data ----------------------------------------------------------------
    # Built after the restore so a resumed run continues in the epoch it left.
    train_data, _ = data.build(config.data, cluster, train_cfg.batch_size, training=True,
                               seed=config.seed, start_step=start_step)
    eval_data, eval_steps = data.build(config.data, cluster, train_cfg.batch_size,
                                       training=False, max_eval_steps=train_cfg.eval_steps)

    # ----- fit -----------------------------------------------------------------
    logger = callbacks.IntervalLogger(
        steps_per_interval=interval, total_steps=train_cfg.steps, global_batch=train_cfg.batch_size,
        tokens_per_example=builder.tokens_per_example(model_kwargs),
        flops_per_example=flops.training_flops_per_example(model),
        peak_flops=peak.peak_flops(cluster, performance.compute_dtype(train_cfg.precision)),
        summary_dir=os.path.join(workdir, "tensorboard") if cluster.is_chief else None)
    history = model.fit(
        train_data, epochs=train_cfg.steps // interval, steps_per_epoch=interval,
        initial_epoch=start_step // interval,
        validation_data=eval_data, validation_steps=eval_steps,
        validation_freq=train_cfg.eval_every // interval,
        callbacks=[logger, checkpoint.SaveEvery(saver, config.checkpoint.every_steps, train_cfg.steps)],
        verbose=1 if sys.stdout.isatty() else 0)

    final = {k: v[-1] for k, v in history.history.items() if k.startswith("val_")}
    if final:
        headline = f"val_{builder.headline}"
        logging.info("done at step %d: %s %.4g", saver.step, headline, final.get(headline, float("nan")))
    # Equal on every host of a synchronous run: a cheap check that hosts agree.
    logging.info("weights fingerprint: %.12e", _fingerprint(model))

    # ----- export --------------------------------------------------------------
    if cluster.is_chief:
        export_dir = os.path.join(workdir, "export")
        model.export(export_dir, verbose=False)
        logging.info("exported SavedModel to %s", export_dir)
    return history


def _fingerprint(model) -> float:
    """The sum of all weights, computed where they live (sharded jax arrays span hosts)."""
    import keras
    return sum(float(keras.ops.convert_to_numpy(keras.ops.sum(w.value))) for w in model.weights)


def _parse_flags(argv):
    """absl flag parsing, with config typos and bad values turned into one line."""
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError) as error:
        message = " ".join(str(error).replace("\\n", " ").strip("'\"").split())
        if "Traceback" in message:  # an exception inside the config file's get_config
            message = f"{message.split(': ')[0]}: {re.findall(r'[A-Za-z]+(?:Error|Exception): (.*)', message)[-1]}"
        typo = re.search(r'Did you mean "(\w+)" instead of "(\w+)"', message)
        if typo:
            right, wrong = typo.groups()
            override = next((a.split("=")[0] for a in argv if f".{wrong}" in a), wrong)
            message = f"unknown config key in {override} (did you mean {right!r}?)"
        _exit_with(message)


def _own_info_only(record) -> bool:
    """Keeps the log readable: INFO lines from tpu_keras, warnings from everyone."""
    return record.levelno >= std_logging.WARNING or "tpu_keras" in record.pathname


def _exit_with(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv):
    if len(argv) > 1:
        _exit_with(f"unexpected arguments {argv[1:]}")
    if _CONFIG.value is None or _WORKDIR.value is None:
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
        train(config, _WORKDIR.value)
    except UserError as error:
        _exit_with(str(error))


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
