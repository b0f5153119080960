"""`python tests/helpers/slow_commit.py ARGS`: `python -m tpu_keras.train ARGS`, with every checkpoint's
files written `SLOW_COMMIT_SECONDS` (3) seconds before the run goes on to commit them.

So a test can kill a run in the middle of a save, between the two steps that
make it atomic, with no test hook in the toolkit itself.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import os
import runpy
import time

import tensorflow as tf

_write = tf.train.Checkpoint.write


def _write_then_wait(self, *args, **kwargs):
    path = _write(self, *args, **kwargs)
    time.sleep(float(os.environ.get("SLOW_COMMIT_SECONDS", 3)))
    return path


tf.train.Checkpoint.write = _write_then_wait
runpy.run_module("tpu_keras.train", run_name="__main__", alter_sys=True)
