"""scripts/benchmark.py --accelerator on a machine without GPU or TPU: one line, exit 0."""

import sys

from conftest import run


def test_accelerator_benchmark_without_accelerator_says_so_in_one_line():
    result = run([sys.executable, "scripts/benchmark.py", "--accelerator"], merge_stderr=False,
                 env={"JAX_PLATFORMS": "cpu"})
    lines = result.stdout.splitlines()
    assert result.returncode == 0
    assert len(lines) == 1 and lines[0].startswith("no accelerator here: JAX sees only cpu devices"), lines
    assert "python scripts/benchmark.py --accelerator" in lines[0]
