"""`python tests/helpers/slow_commit.py ARGS`: `python -m tpu_keras.train ARGS`, with each
checkpoint's files written `SLOW_COMMIT_SECONDS` (3) seconds before it is committed.

`SLOW_COMMIT_STEP`, when set, slows only the checkpoint of that step. On the tf
engine the wait comes after TensorFlow writes the files and before the toolkit
rewrites the state file; on the jax engine, before Orbax renames its temporary
folder. With asynchronous saves both happen on the writer thread, while
training goes on. So a test can kill a run in the middle of a save, between
the two steps that make it atomic, with no test hook in the toolkit itself.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import os
import re
import runpy
import time


def _slowed(path) -> bool:
    step = os.environ.get("SLOW_COMMIT_STEP")
    return step is None or re.search(rf"(ckpt-|/){step}$", str(path).rstrip("/")) is not None


def _wait():
    time.sleep(float(os.environ.get("SLOW_COMMIT_SECONDS", 3)))


if "--config.engine=jax" in os.sys.argv:
    from orbax.checkpoint._src.path import atomicity  # orbax-checkpoint 0.12: local folders

    _finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def _finalize_later(self, *args, **kwargs):
        if _slowed(self.get_final()):
            _wait()
        return await _finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = _finalize_later
else:
    import tensorflow as tf

    _write = tf.train.Checkpoint.write

    def _write_then_wait(self, file_prefix, *args, **kwargs):
        path = _write(self, file_prefix, *args, **kwargs)
        if _slowed(file_prefix):
            _wait()
        return path

    tf.train.Checkpoint.write = _write_then_wait

runpy.run_module("tpu_keras.train", run_name="__main__", alter_sys=True)
