"""Helpers for the resume tests: runs to interrupt, their checkpoints and their example ids.

Every run here is the digits MLP (with dropout, so its random state must
resume too) under TensorFlow op determinism, 40 steps, a checkpoint every
10, logging every batch's example ids (`data.log_example_ids`).
"""

import collections
import contextlib
import glob
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, run_command

DIGITS = "configs/digits.py:tiny"
STEPS = 40
ARGS = ("--config.deterministic=True", f"--config.train.steps={STEPS}",
        "--config.train.eval_every=20", "--config.log.every_steps=10",
        "--config.checkpoint.every_steps=10", "--config.train.steps_per_execution=2",
        "--config.data.log_example_ids=True")


def train_args(workdir, data_dir, *extra):
    return [sys.executable, "-m", "tpu_keras.train", f"--config={DIGITS}", f"--workdir={workdir}",
            f"--config.data.data_dir={data_dir}", *ARGS, *extra]


def start(args, **env):
    """Starts `args` from the repo root, output (stderr too) readable line by line."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", **env}
    full_env.pop("TF_CONFIG", None)
    return subprocess.Popen(args, cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=full_env)


@contextlib.contextmanager
def running(args, **env):
    """`start(args)` for the block; killed (a PID it started) if it outlives the block."""
    process = start(args, **env)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def read_until(process, pattern, timeout=240):
    """Reads the process's output until a line matches `pattern`; returns all lines read."""
    lines, deadline = [], time.time() + timeout
    for line in process.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return lines
        assert time.time() < deadline, f"no line matched {pattern!r}:\n{''.join(lines[-30:])}"
    pytest.fail(f"exited {process.wait()} before a line matched {pattern!r}:\n{''.join(lines[-30:])}")


def finish(process, timeout=240):
    """Waits for `process` (killing it after `timeout`); returns the rest of its output."""
    try:
        rest, _ = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return rest


def killed_after_checkpoint_then_resumed(args, step: int, timeout=300) -> str:
    """Starts the training command `args`, kills it (SIGKILL, a PID it started) once it
    has saved checkpoint `step`, runs the same command to the end; returns that output."""
    process = start(args)
    try:
        read_until(process, rf"saved checkpoint \S*(ckpt-|/){step}\b")  # tf, Orbax
    finally:
        process.kill()
        process.wait()
    return run_command(args, timeout=timeout).stdout


def committed_steps(workdir):
    state = (workdir / "checkpoints" / "checkpoint").read_text()
    return sorted(int(s) for s in re.findall(r'all_model_checkpoint_paths: "ckpt-(\d+)"', state))


def weights(workdir, step=STEPS):
    """{name: array} of the checkpoint of `step`: TensorFlow's format, or Orbax's (jax engine)."""
    orbax_dir = workdir / "checkpoints" / str(step) / "default"
    if orbax_dir.is_dir():
        import jax
        import orbax.checkpoint as ocp
        checkpointer = ocp.StandardCheckpointer()
        saved = checkpointer.metadata(str(orbax_dir))
        saved = getattr(getattr(saved, "item_metadata", saved), "tree", saved)
        # Onto this process's one device, whatever mesh saved it.
        here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        tree = checkpointer.restore(str(orbax_dir), jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=here), saved))
        return {f"{group}/{key}": np.asarray(value) for group, values in tree.items()
                for key, value in (values.items() if isinstance(values, dict) else enumerate(values))}
    import tensorflow as tf
    reader = tf.train.load_checkpoint(str(workdir / "checkpoints" / f"ckpt-{step}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def assert_same_weights(workdir, reference, step=STEPS):
    ours, theirs = weights(workdir, step), weights(reference, step)
    assert ours.keys() == theirs.keys()
    worst = max(float(np.max(np.abs(ours[k].astype(np.float64) - theirs[k]))) for k in ours)
    assert worst <= 1e-6, worst


def example_ids(folder, steps=STEPS):
    """{(host, batch position): sorted example ids}, from every host's log in `folder`, for
    the run's `steps` positions (a host reads ahead, past the last).

    A batch read twice (Keras reads the first one to build the model, then
    starts over) is logged twice: each host's distinct lines count once.
    """
    seen = collections.defaultdict(list)
    for path in glob.glob(str(folder / "host*.txt")):
        host = int(re.search(r"host(\d+)\.txt$", path).group(1))
        for line in set(open(path)):
            position, ids = re.match(r"(\d+) \[([\d ]*)\]", line).groups()
            seen[host, int(position)] += [int(i) for i in ids.split()]
    return {key: sorted(ids) for key, ids in seen.items() if key[1] < steps}


def seen_over_the_run(first_attempt, second_attempt, resumed_at):
    """What trained: the first attempt's batches before the resume, the second's from it on.

    The batches a host of the first attempt read (or prefetched) past the
    checkpoint were lost with it; they must be the very batches it reads
    again in the second.
    """
    for key in set(first_attempt) & set(second_attempt):
        assert first_attempt[key] == second_attempt[key], key
    ids = {key: i for key, i in first_attempt.items() if key[1] < resumed_at}
    ids.update({key: i for key, i in second_attempt.items() if key[1] >= resumed_at})
    return ids


def resumed_step(output):
    """The step a run resumed from; 0 if it was killed before its first checkpoint."""
    resumed = re.search(r"resumed from \S+ at step (\d+)", output)  # tf's ckpt-N, Orbax's folder
    return int(resumed.group(1)) if resumed else 0
