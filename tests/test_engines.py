"""The two engines are one trainer: the same config, initial weights and batches give the
same step losses on the tf engine and on the jax engine (one device each)."""

import json
import sys

import pytest

from conftest import run_command


def losses(engine, config, data_dir, init, overrides):
    out = run_command([sys.executable, "tests/helpers/engine_probe.py", engine, config, data_dir, str(init),
               json.dumps(overrides)]).stdout
    return json.loads(next(l for l in out.splitlines() if l.startswith("ENGINE "))[7:])


@pytest.mark.parametrize("config,overrides", [
    pytest.param("configs/lm_stdlib.py", {"model": {"depth": 1}},  # one block: a second adds compile time
                 marks=pytest.mark.slow),
    # Dropout draws different masks on the two backends: off, the MLP is deterministic.
    pytest.param("configs/digits.py:mlp", {"model": {"dropout": 0.0}}, marks=pytest.mark.slow),  # over 15 s: the full suite's (the fast tier keeps within 5 minutes)
], ids=["gpt", "mlp"])
def test_tf_and_jax_give_the_same_ten_losses(data_dir, tmp_path, config, overrides):
    init = tmp_path / "init.npz"  # the tf run saves it, the jax run starts from it
    tf_run, jax_run = (losses(engine, config, data_dir, init, overrides) for engine in ("tf", "jax"))
    assert len(tf_run["losses"]) == len(jax_run["losses"]) == 10
    for step, (a, b) in enumerate(zip(tf_run["losses"], jax_run["losses"])):
        assert abs(a - b) <= 1e-4, (step, tf_run["losses"], jax_run["losses"])
    # The gradient norm (what clipping and the NaN guard read) agrees too: on tf, an
    # embedding's gradient is made dense first, as it is on jax.
    for step, (a, b) in enumerate(zip(tf_run["grad_norms"], jax_run["grad_norms"])):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(b)), (step, tf_run["grad_norms"], jax_run["grad_norms"])
