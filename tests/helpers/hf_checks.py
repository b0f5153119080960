"""What the transformers-checkpoint tests share: the tolerances, the probe
(tests/helpers/hf_probe.py, one process) and the check of a refused input."""

import json
import sys

from conftest import assert_one_line_error, run_command

TOLERANCE = 1e-5  # keras-hub against keras-hub, the same operations
TRANSFORMERS = 1e-4  # the toolkit against transformers' own PyTorch model, float32
FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
EVERY_PROJECTION = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def probe(engine, out, data_dir, mesh, runs, checkpoints, env=None, lean=False):
    """hf_probe.py's figures; `lean`: a LoRA run computes only what the MoE mesh test reads."""
    result = run_command([sys.executable, "tests/helpers/hf_probe.py", engine, str(out), data_dir, mesh,
                          ",".join(runs), ",".join(checkpoints), *(["lean"] if lean else [])],
                         timeout=900, env=env)
    return json.loads(next(line[3:] for line in result.stdout.splitlines() if line.startswith("HF ")))


def assert_refused(result, *fragments):
    """A mistake in the input: one line with `fragments`, and exit code 2."""
    assert_one_line_error(result, *fragments)
    assert result.returncode == 2, (result.stdout + (result.stderr or ""))[-2000:]
