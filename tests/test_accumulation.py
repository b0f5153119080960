"""Gradient accumulation: k micro-batches make one update equal to one update on their union,
one token mean over every replica and micro-batch, and a run with accumulation resumes
exactly after a kill.

The tf engine is checked here under Mirrored (two replicas: the summed micro-batch
gradients also cross replicas); the jax engine's accumulation, on an fsdp mesh, is
test_user_code.py's (the same step functions, reached from the user's own model)."""

import json
import re
import sys

import pytest

from conftest import run_command
from resume import assert_same_weights, killed_after_checkpoint_then_resumed, resumed_step, train_args

pytestmark = pytest.mark.slow  # each check trains several runs or a simulated pod


def test_four_micro_batches_make_the_update_of_their_union_under_mirrored(data_dir):
    out = run_command([sys.executable, "tests/helpers/accum_probe.py", "tf", data_dir, "2"]).stdout
    result = json.loads(next(l for l in out.splitlines() if l.startswith("ACCUM "))[6:])
    assert result["moved"] > 1e-3, result  # the update is real
    assert result["between"] <= 1e-5, result


@pytest.mark.parametrize("engine", ["tf", "jax"])
def test_a_step_split_over_replicas_and_micro_batches_takes_one_token_mean(engine):
    """tests/helpers/token_mean_probe.py: rows of 1 to 16 weighted targets, split over 2 tf
    replicas (jax: a data 2 x model 2 mesh) and 2 micro-batches, against numpy and against
    the same step on one device and one batch; and split so with the loss in 4 pieces of the
    sequence (train.loss_chunks), against the split step with whole logits."""
    out = run_command([sys.executable, "tests/helpers/token_mean_probe.py", engine]).stdout
    got = json.loads(re.search(r"^TOKENS (.*)$", out, re.M).group(1))
    assert got["devices"] == (2 if engine == "tf" else 4), got
    # The global mean over targets (float32 against float64: within 1e-6 of it, relative).
    assert got["split_loss"] == pytest.approx(got["numpy"], rel=1e-6), got
    assert got["whole_loss"] == pytest.approx(got["numpy"], rel=1e-6), got
    assert got["moved"] > 0.1 and got["between_updates"] < 1e-5, got  # the same update
    # train.loss_chunks=4: the head and loss in pieces of the sequence, the same loss and update
    # (SGD: the update is the gradient times the learning rate)
    assert got["chunked_loss"] == pytest.approx(got["split_loss"], rel=1e-6), got
    assert got["chunked_against_split"] <= 1e-6 * got["moved"], got
    # evaluate: the mean over every weighted target of both batches, not of the batch means
    for name in ("split_evaluate", "whole_evaluate", "chunked_evaluate"):
        assert got[name] == pytest.approx(got["numpy_evaluate"], rel=1e-6), (name, got)


def test_a_run_with_accumulation_killed_mid_run_resumes_to_the_same_weights(data_dir, tmp_path):
    extra = ("--config.train.grad_accum_steps=2", "--config.train.batch_size=32")
    reference = run_command(train_args(tmp_path / "reference", data_dir, *extra), timeout=300).stdout
    assert "2 micro-batches of 32 per update" in reference, reference[-2000:]
    resumed = killed_after_checkpoint_then_resumed(train_args(tmp_path / "killed", data_dir, *extra),
                                                   step=20)
    assert resumed_step(resumed) == 20, resumed[-2000:]
    assert_same_weights(tmp_path / "killed", tmp_path / "reference")
