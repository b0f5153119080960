"""A workdir on a filesystem other than the local disk, as `gs://` is on a pod.

TensorFlow's `ram://` filesystem stands in for `gs://`: it lives in one
process's memory, so the run and its resume happen in one process, started
in an empty folder that must stay empty.
"""

import json
import re
import sys

import pytest

from conftest import REPO, run_command

pytestmark = pytest.mark.slow  # a whole run and its resume, in a process of its own

SCRIPT = f"""
import json, os, sys
sys.path.insert(0, {str(REPO / "configs")!r})
import lm_stdlib
import tensorflow as tf
from absl import logging
from tpu_keras.training import loop

logging.set_verbosity(logging.INFO)

config = lm_stdlib.get_config("tiny")
config.data.update(data_dir=sys.argv[1], log_example_ids=True)
config.train.steps = 10
loop.train(config, "ram://run")
config.train.steps = 20
history = loop.train(config, "ram://run")
print("FILES", json.dumps(sorted(os.path.relpath(os.path.join(root, f), "ram://run")
                                  for root, _, files in tf.io.gfile.walk("ram://run") for f in files)))
print("TIMINGS", json.dumps(json.load(tf.io.gfile.GFile("ram://run/timings.json"))))
print("CWD", json.dumps(os.listdir(".")))
"""


def test_a_run_and_its_resume_on_ram_write_nothing_locally(tmp_path, data_dir):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = run_command([sys.executable, "-c", SCRIPT, data_dir], cwd=cwd)
    output = result.stdout
    assert "resumed from ram://run/checkpoints/ckpt-10 at step 10" in output, output[-3000:]
    files = json.loads(output.split("FILES ", 1)[1].splitlines()[0])
    for expected in ("config.json", "checkpoints/checkpoint", "checkpoints/ckpt-20.index",
                     "example_ids/host0.txt",
                     "export/saved_model.pb", "timings.json"):
        assert expected in files, files
    assert any(f.startswith("tensorboard/events.out.tfevents.") for f in files), files
    # The second run's time breakdown: its phases add up to its wall time.
    timings = json.loads(output.split("TIMINGS ", 1)[1].splitlines()[0])
    assert timings["seconds"]["steps"] > 0 and 0 < timings["outside_steps_fraction"] < 1
    assert sum(timings["seconds"].values()) == pytest.approx(timings["wall_seconds"], rel=0.01)
    # The process's peak resident memory, in bytes: TensorFlow and a model take more than 64 MiB,
    # and no process more than the machine has.
    with open("/proc/meminfo") as meminfo:
        machine = int(meminfo.readline().split()[1]) * 1024
    assert 64 * 2**20 < timings["peak_host_bytes"] < machine, timings
    assert re.search(r"time: .* \| peak host memory \d+\.\d\d GiB", output), output[-2000:]
    assert json.loads(output.split("CWD ", 1)[1].splitlines()[0]) == []
    assert not list(cwd.iterdir())
