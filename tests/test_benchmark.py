"""scripts/benchmark.py: --accelerator on a machine without GPU or TPU is one line and exit 0;
stdout holds the JSON alone, even while a dataset is prepared; the race of --fit favours no
model by its place or by the model run before it."""

import json
import os
import sys

import pytest

from conftest import REPO, run_command


def test_accelerator_benchmark_without_accelerator_says_so_in_one_line():
    result = run_command([sys.executable, "scripts/benchmark.py", "--accelerator"], merge_stderr=False,
                         env={"JAX_PLATFORMS": "cpu"})
    lines = result.stdout.splitlines()
    assert result.returncode == 0
    assert len(lines) == 1 and lines[0].startswith("no accelerator here: JAX sees only cpu devices"), lines
    assert "python scripts/benchmark.py --accelerator" in lines[0]


@pytest.mark.slow
def test_stdout_is_the_json_alone_while_a_dataset_is_prepared(tmp_path):
    """A fresh home: TFDS prepares the digits and says so, on stderr, not in the JSON."""
    result = run_command([sys.executable, "scripts/benchmark.py", "--data", "--configs=digits",
                  "--seconds=0.2"], merge_stderr=False, env={"HOME": str(tmp_path)})
    assert json.loads(result.stdout)["benchmark"] == "data", result.stdout[-2000:]
    assert "Dataset digits" in result.stderr or "preparing" in result.stderr, result.stderr[-2000:]


def test_the_race_order_gives_no_model_a_place_or_a_predecessor_more_often(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "scripts"))
    from benchmark_timing import turn_order
    four = ["toolkit", "toolkit_bf16", "keras_defaults", "keras_tuned"]
    for names in (four[::3], four[:3], four):
        n = len(names)
        rounds = [turn_order(names, turn) for turn in range(n if n % 2 == 0 else 2 * n)]
        assert all(sorted(order) == sorted(names) for order in rounds)
        places = {(name, order.index(name)) for order in rounds for name in order}
        assert len(places) == n * n  # every name in every place
        follows = [(a, b) for order in rounds for a, b in zip(order, order[1:])]
        assert len(set(follows)) == n * (n - 1)  # every name right after every other ...
        assert len(follows) == len(set(follows)) * (1 if n % 2 == 0 else 2)  # ... equally often
