"""Examples packed apart (tpu_keras/data/packing.py, tpu_keras/models/segments.py): a packed
row's logits at every real token are each example's alone, for the gpt builder and keras-hub's
Llama, Qwen 3, SmolLM3 (layers without rotary positions), Gemma 3 and 4 (sliding-window layers)
and Qwen 3.5 (Gated DeltaNet layers: state and convolution restarted per example, the rule over
one example keras-hub's) on both engines; configs/instruct_stdlib.py logs its padding share,
small, and a packed instruction run killed with SIGKILL resumes to the same weights.
Elsewhere: every pair whole in one row and each token once per epoch, on simulated hosts
(test_data.py); the splash kernel on packed rows (test_hub.py); evaluate against transformers,
each pair alone (test_hub_transformers.py); an example longer than a row (test_errors.py)."""

import json
import re
import sys

import pytest

from conftest import run_command, train
from resume import assert_same_weights, killed_after_checkpoint_then_resumed, resumed_step

INSTRUCT_TINY = "configs/instruct_stdlib.py:tiny"


@pytest.mark.parametrize("engine, models", [
    # over 15 s each: the full suite's (the fast tier keeps within 5 minutes); one process an engine
    pytest.param("tf", "gpt,llama,qwen3,smollm3,gemma3,gemma4,qwen3_5", marks=pytest.mark.slow),
    pytest.param("jax", "gpt,llama,qwen3,smollm3,gemma3,gemma4,qwen3_5", marks=pytest.mark.slow)])
def test_a_packed_rows_logits_are_each_examples_alone(engine, models):
    out = run_command([sys.executable, "tests/helpers/segments_probe.py", engine, models]).stdout
    got = json.loads(re.search(r"^SEGMENTS (.*)$", out, re.M).group(1))
    assert sorted(got) == sorted(models.split(",")), got
    for model in got:  # learned positions restarted; rotary ones kept
        # Gemma 4 on tf: 2e-5 measured, exact at each example's first token and growing with its
        # offset in the row (rounding in its rotary positions, unscaled attention logits); 2e-6
        # on jax.
        assert got[model]["alone"] < (5e-5 if (engine, model) == ("tf", "gemma4") else 1e-5), (model, got)
        assert got[model]["stream"] > 1e-2, (model, got)  # the same row as one stream differs
    if "qwen3_5" in got:  # the gated delta rule over one example: keras-hub's, to float32 rounding
        assert got["qwen3_5"]["rule"] < 1e-5, got


@pytest.mark.slow
def test_packed_instruction_data_logs_its_padding_and_resumes_exactly(data_dir, stdlib_text, tmp_path):
    args = (f"--config.data.data_dir={data_dir}", "--config.deterministic=True")
    reference = train(INSTRUCT_TINY, tmp_path / "reference", *args).stdout
    shares = [float(s) for s in re.findall(r"packed apart into [\d,]+ rows, ([\d.]+)% of their tokens "
                                            r"padding", reference)]
    assert len(shares) == 2 and max(shares) <= 5.0, reference[-3000:]  # train and validation
    command = [sys.executable, "-m", "tpu_keras.train", f"--config={INSTRUCT_TINY}",
               f"--workdir={tmp_path / 'killed'}", *args]
    resumed = killed_after_checkpoint_then_resumed(command, step=10)
    assert resumed_step(resumed) == 10, resumed[-2000:]
    losses = lambda out: re.findall(r"step 20/20 \| .*?loss (\S+)", out)
    assert losses(resumed) == losses(reference), (losses(resumed), losses(reference))
    assert_same_weights(tmp_path / "killed", tmp_path / "reference", step=20)
