"""`python -m tpu_keras.plan`: memory per device on a TPU slice, checked against what can run here.

The exact figures (parameters, optimizer state) are checked against really
sharded variables in test_parallel.py; here the activation estimate meets
XLA's own buffer assignment, and the planner's answers meet each other.
"""

import json
import sys

import pytest

from conftest import assert_one_line_error, run


def plan(*args, check=True):
    result = run([sys.executable, "-m", "tpu_keras.plan", *args, "--json"], merge_stderr=False,
                 check=check)
    return json.loads(result.stdout) if check else result


# float32: with bf16, CPU XLA keeps float32 copies that a TPU does not (tpu_keras.memory).
@pytest.mark.parametrize("config", ["configs/lm_stdlib.py", "configs/digits.py"],
                         ids=["gpt", "digits_mlp"])
def test_activation_estimate_is_within_25_percent_of_xla(config):
    result = plan(f"--config={config}", "--tpu=v5litepod-8", "--config.train.precision=float32",
                  "--measure")
    estimate = result["per_device"]["activations"]
    measured = result["measured_activations"]["bytes"]
    assert measured > 0 and abs(estimate / measured - 1) <= 0.25, (estimate, measured)


def test_the_largest_batch_fits_and_one_more_per_replica_does_not():
    # The 5-minute gpt on a v5litepod-8 in bf16: 8 replicas of 16 GiB.
    args = ["--config=configs/lm_stdlib.py", "--tpu=v5litepod-8"]
    first = plan(*args)
    assert first["fits"] and first["devices"] == 8 and first["hosts"] == 1
    assert first["mesh"] == {"data": 8, "fsdp": 1, "model": 1} and first["precision"] == "mixed_bfloat16"
    assert first["per_device"]["gradients"] == first["per_device"]["parameters"]  # all trainable
    largest = first["largest_global_batch"]
    assert largest % 8 == 0 and largest > first["global_batch"]
    at_largest = plan(*args, f"--config.train.batch_size={largest}")
    assert at_largest["fits"] and at_largest["largest_global_batch"] == largest
    # One more example per replica: the table says it does not fit, and what to do.
    too_big = run([sys.executable, "-m", "tpu_keras.plan", *args,
                   f"--config.train.batch_size={largest + 8}"]).stdout
    assert "gpt on v5litepod-8: 8 devices on 1 host(s), 16.00 GiB HBM per device" in too_big
    assert "fits: NO" in too_big and "lower train.batch_size" in too_big
    assert f"largest global batch that fits: {largest:,} ({largest // 8:,} per replica)" in too_big


@pytest.mark.parametrize("args,fragments", [
    (["--tpu=v4-31"], ["TPU slice 'v4-31' does not exist"]),
    (["--tpu=v5p-64", "--config.train.batch_size=33"],
     ["train.batch_size=33 does not divide over the 32 batch splits (data x fsdp)", "multiple of 32"]),
    (["--tpu=v4-8", "--config.mesh.model=2"], ["needs the jax engine"]),
    (["--tpu=v4-8", "--margin=1.5"], ["--margin=1.5"]),
], ids=["unknown-slice", "indivisible-batch", "tf-model-axis", "margin"])
def test_bad_input_is_one_line(args, fragments):
    result = run([sys.executable, "-m", "tpu_keras.plan", "--config=configs/lm_stdlib.py", *args],
                 check=False)
    assert_one_line_error(result, *fragments)
