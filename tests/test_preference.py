"""Preference tuning (DPO) on keras-hub's Llama: the loss against numpy on both engines (LoRA,
and a full fine-tune's frozen reference), the offline example learning, a kill -9 resumed
exactly, and evaluation."""

import json
import re
import sys

import numpy as np
import pytest

from conftest import run_command, train
from resume import assert_same_weights, killed_after_checkpoint_then_resumed, resumed_step, weights

DPO_TINY = "configs/preference_stdlib.py:tiny"


# LoRA's reference (the adapters off) on tf, a full fine-tune's (a frozen copy) on a jax mesh
# that splits the weights; the tiny run below trains LoRA on jax.
@pytest.mark.parametrize("engine, mesh, full, base", [
    pytest.param("tf", "", False, "", marks=pytest.mark.slow),  # over 15 s: the full suite's (the fast tier keeps within 5 minutes)
    pytest.param("jax", "fsdp2_model2", True, "", marks=pytest.mark.slow),
    pytest.param("jax", "fsdp2_model2", False, "int8", marks=pytest.mark.slow)],
                         ids=["tf-lora", "jax-fsdp2-model2-full", "jax-fsdp2-model2-lora-int8-base"])
def test_dpo_scores_loss_and_rewards_equal_numpy(engine, mesh, full, base, data_dir, tmp_path):
    """tests/helpers/dpo_probe.py: eight real pairs, the policy moved (adapters set at random;
    full: noise on every weight), the engine's own evaluation against numpy's log-softmax
    of the policy's and the starting model's logits (over an int8 base: that base's)."""
    out = run_command([sys.executable, "tests/helpers/dpo_probe.py", engine, data_dir, str(tmp_path / "run"),
               *([mesh] if mesh else []), *(["full"] if full else []), *([base] if base else [])],
                      timeout=300).stdout
    got = json.loads(re.search(r"^DPO (.*)$", out, re.M).group(1))
    assert got["devices"] == (4 if mesh else 1) and got["full"] == full, got
    assert (got["int8_kernels"] > 0) == (base == "int8"), got  # the reference is the int8 base
    assert (got["split_weights"] > 0) == bool(mesh), got  # the mesh splits weights
    # Adapters start at zero: the policy is its reference, every reward 0, every pair a tie.
    # Over an int8 base the two paths part by rounding (rewards of about 5e-8 here): a tie
    # is then broken either way.
    untrained = got["untrained"]
    if base:
        assert untrained["loss"] == pytest.approx(np.log(2), abs=1e-6), got
        assert max(abs(untrained[k]) for k in ("reward_chosen", "reward_margin", "reward_rejected")) < 1e-6
    else:
        assert untrained == {"loss": pytest.approx(np.log(2), abs=1e-6), "reward_accuracy": 0.5,
                             "reward_chosen": 0.0, "reward_margin": 0.0, "reward_rejected": 0.0}
    moved = got["evaluated"]
    assert max(abs(moved["reward_chosen"]), abs(moved["reward_rejected"])) > 1e-3, got  # adapters on
    assert got["largest_difference"] < 1e-5, got
    assert got["score_relative_difference"] < 1e-5, got
    # Weight 0 on the start token and the prompt, 1 on the response and its end token.
    assert got["masks_exact"] and got["prompt_tokens"] > 0, got
    assert got["trainable"] == got["policy_trainable"], got  # the reference never trains
    if full:  # the reference: a frozen copy of the policy, as training started
        assert got["weights"] == 2 * got["policy_weights"], got
        assert got["parameters"] == 2 * got["policy_parameters"], got
    else:  # LoRA: no second copy of the base, the pairs model holds the policy's weights alone
        assert got["weights"] == got["policy_weights"], got
        assert got["parameters"] == got["policy_parameters"], got


@pytest.mark.slow
def test_dpo_raises_reward_accuracy_resumes_exactly_after_a_kill_and_evaluates(data_dir, tmp_path):
    # On jax, the second and third starts read their programs from the compile cache.
    args = (f"--config.data.data_dir={data_dir}", "--config.deterministic=True",
            "--config.engine=jax", "--config.export.formats=('keras_hub',)")  # the cheapest export
    reference = train(DPO_TINY, tmp_path / "reference", *args).stdout
    assert "wrote a freshly initialised LlamaBackbone" in reference
    # LoRA rank 8 on the query and value of one block, 8 x (32 + 32) each: all that trains.
    assert "76,896 parameters, 1,024 of them trainable (1.3%)" in reference, reference[-3000:]
    accuracy = [float(a) for a in re.findall(r"\| val_reward_accuracy (\S+)", reference)]
    assert len(accuracy) == 2 and accuracy[-1] >= 0.8, reference[-3000:]
    for name in ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy"):
        assert re.search(rf"step 20/20 \|.* {name} -?\d", reference), name

    # The checkpoint holds the 1,024 LoRA values and the optimizer's two moments of them: the
    # base (and DPO's reference, the base itself) is read from model.preset again.
    saved = weights(tmp_path / "reference", step=20)
    sizes = lambda group: sum(v.size for k, v in saved.items() if k.startswith(group) and v.ndim)
    assert sizes("optimizer_by_path/") == 2 * 1024, sorted(saved)
    assert sizes("model_by_path/") == 1024, sorted(saved)

    command = [sys.executable, "-m", "tpu_keras.train", f"--config={DPO_TINY}",
               f"--workdir={tmp_path / 'killed'}", *args]
    resumed = killed_after_checkpoint_then_resumed(command, step=10)
    assert resumed_step(resumed) == 10, resumed[-2000:]
    assert_same_weights(tmp_path / "killed", tmp_path / "reference", step=20)

    evaluated = run_command([sys.executable, "-m", "tpu_keras.evaluate",
                     f"--workdir={tmp_path / 'reference'}"]).stdout
    line = re.search(r"^step 20 \| (.*)$", evaluated, re.M).group(1)
    again = float(re.search(r"val_reward_accuracy (\S+)", line).group(1))
    assert again == pytest.approx(accuracy[-1], abs=5e-4), (line, accuracy)
    events = b"".join(p.read_bytes() for p in (tmp_path / "reference" / "tensorboard").rglob("events*"))
    assert b"reward_margin" in events and b"val_reward_accuracy" in events
