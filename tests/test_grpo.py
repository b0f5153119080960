"""GRPO's objective against numpy, written here from the papers' and TRL's formulas: the
group advantages (and Dr.GRPO's, unscaled), the clipped ratio's loss under each of TRL's
loss types, the k3 KL and the clip fraction, within 1e-5; a prompt's tokens weigh exactly
0, and a group whose rewards are all equal gives no gradient."""

import glob
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import run_command, train
from resume import assert_same_weights, killed_after_checkpoint_then_resumed, resumed_step, weights

GROUP, LOW, HIGH, BETA, LONGEST = 4, 0.2, 0.28, 0.04, 7


def batch(path):
    """3 prompts x 4 completions of up to 7 tokens after a 3-token prompt: the mask is 0 on
    the prompt and past each completion's end. The second group's rewards are all equal."""
    rng = np.random.default_rng(0)
    rows, length = 3 * GROUP, 3 + LONGEST
    rewards = rng.normal(size=rows).astype(np.float32)
    rewards[GROUP:2 * GROUP] = 0.5
    ends = 3 + rng.integers(1, LONGEST + 1, rows)
    mask = ((np.arange(length) >= 3) & (np.arange(length) < ends[:, None])).astype(np.float32)
    old = rng.normal(-2.0, 0.5, (rows, length)).astype(np.float32)
    logp = (old + rng.normal(0, 0.3, (rows, length))).astype(np.float32)  # some ratios past the clip
    ref = (old + rng.normal(0, 0.2, (rows, length))).astype(np.float32)
    np.savez(path, rewards=rewards, logp=logp, old=old, ref=ref, mask=mask, group_size=GROUP,
             epsilon_low=LOW, epsilon_high=HIGH, beta=BETA, max_new_tokens=LONGEST)
    return dict(rewards=rewards.astype(np.float64), logp=logp.astype(np.float64),
                old=old.astype(np.float64), ref=ref.astype(np.float64), mask=mask.astype(np.float64))


def numpy_grpo(b, scale=True, beta=BETA):
    grouped = b["rewards"].reshape(-1, GROUP)
    advantage = grouped - grouped.mean(1, keepdims=True)
    if scale:
        advantage = advantage / (grouped.std(1, ddof=1, keepdims=True) + 1e-4)
    advantage = advantage.reshape(-1, 1)
    ratio = np.exp(b["logp"] - b["old"])
    objective = np.minimum(ratio * advantage, np.clip(ratio, 1 - LOW, 1 + HIGH) * advantage)
    kl = np.exp(b["ref"] - b["logp"]) - (b["ref"] - b["logp"]) - 1
    per_token = -objective + beta * kl
    mask = b["mask"]
    losses = {"dapo": (per_token * mask).sum() / mask.sum(),
              "grpo": ((per_token * mask).sum(1) / mask.sum(1)).mean(),
              "dr_grpo": (per_token * mask).sum() / (len(mask) * LONGEST)}
    clipped = ((ratio < 1 - LOW) & (advantage < 0)) | ((ratio > 1 + HIGH) & (advantage > 0))
    return {"advantages": advantage[:, 0], "losses": losses, "kl": (kl * mask).sum() / mask.sum(),
            "clip_fraction": (clipped * mask).sum() / mask.sum()}


@pytest.mark.slow
def test_the_objective_equals_numpy_and_weighs_prompts_and_equal_groups_zero(tmp_path):
    b = batch(tmp_path / "batch.npz")
    out = run_command([sys.executable, "tests/helpers/grpo_probe.py", str(tmp_path / "batch.npz")]).stdout
    got = json.loads(re.search(r"^GRPO (.*)$", out, re.M).group(1))
    want = numpy_grpo(b)
    np.testing.assert_allclose(got["advantages_scaled_True"], want["advantages"], atol=1e-5)
    unscaled = numpy_grpo(b, scale=False)
    np.testing.assert_allclose(got["advantages_scaled_False"], unscaled["advantages"], atol=1e-5)
    for loss_type, value in want["losses"].items():
        assert abs(got[f"loss_{loss_type}"] - value) <= 1e-5 * max(1.0, abs(value)), (loss_type, got, value)
    assert abs(got["loss_dr_grpo_unscaled"] - unscaled["losses"]["dr_grpo"]) <= 1e-5
    assert abs(got["kl"] - want["kl"]) <= 1e-5 and want["kl"] > 0
    assert abs(got["clip_fraction"] - want["clip_fraction"]) <= 1e-5
    assert 0 < want["clip_fraction"] < 0.5  # the batch has clipped tokens, and unclipped ones
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        gradient = np.array(got[f"grad_{loss_type}"])
        assert np.all(gradient[:, :3] == 0), loss_type  # the prompt's tokens weigh exactly 0
        assert np.all(gradient[b["mask"] == 0] == 0), loss_type  # ... and the padding
    # With beta 0, the group whose rewards are all equal gives no gradient at all; the
    # others do. (With beta > 0 its KL term still pulls it to the reference.)
    no_kl = np.array(got["grad_no_kl"])
    assert np.all(no_kl[GROUP:2 * GROUP] == 0)
    assert np.abs(no_kl[:GROUP]).sum() > 0 and np.abs(no_kl[2 * GROUP:]).sum() > 0
    assert np.abs(np.array(got["grad_dapo"])[GROUP:2 * GROUP]).sum() > 0


REWARDS = '''
def is_four(prompts, completions, answer):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]

def short(prompts, completions, **fields):
    return [-len(c) / 10 for c in completions]

def too_few(prompts, completions, **fields):
    return [1.0]

def not_finite(prompts, completions, **fields):
    return [float("nan")] * len(completions)

def words(prompts, completions, **fields):
    return "good"
'''

CALLS = '''
import json, sys
from tpu_keras.errors import UserError
from tpu_keras.models import rewards
folder = sys.argv[1]
prompts, completions = ["2+2="] * 3, ["4", " 4 ", "five"]
total, each = rewards.score(rewards.load([f"{folder}/my_rewards.py:is_four", f"{folder}/my_rewards.py:short"],
                                         [2.0, 1.0]), prompts, completions, {"answer": ["4"] * 3})
print("SCORE " + json.dumps({"total": total.tolist(), "each": {k: v.tolist() for k, v in each.items()}}))
for case, names in {"missing_module": ["no_such_rewards:f"], "missing_function": [f"{folder}/my_rewards.py:nope"],
                    "not_module_function": ["is_four"], "too_few": [f"{folder}/my_rewards.py:too_few"],
                    "not_finite": [f"{folder}/my_rewards.py:not_finite"], "words": [f"{folder}/my_rewards.py:words"],
                    "weights": [f"{folder}/my_rewards.py:short"] * 2}.items():
    try:
        rewards.score(rewards.load(names, [1.0] if case == "weights" else (), key="grpo.rewards"),
                      prompts, completions, {})
        print("ERROR", case, "none")
    except UserError as error:
        print("ERROR", case, error)
'''


def test_reward_functions_sum_with_weights_and_each_bad_one_is_one_line(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    out = run_command([sys.executable, "-c", CALLS, str(tmp_path)]).stdout
    got = json.loads(re.search(r"^SCORE (.*)$", out, re.M).group(1))
    np.testing.assert_allclose(got["total"], [2 - 0.1, 2 - 0.3, 0 - 0.4], atol=1e-6)
    assert list(got["each"]) == [f"{tmp_path}/my_rewards.py:is_four", f"{tmp_path}/my_rewards.py:short"]
    errors = dict(line.split(" ", 2)[1:] for line in out.splitlines() if line.startswith("ERROR "))
    assert "no_such_rewards:f" in errors["missing_module"] and "cannot be imported" in errors["missing_module"]
    assert "has no function 'nope'" in errors["missing_function"]
    assert "is not 'module:function'" in errors["not_module_function"]
    assert "returned 1 value(s) for 3 completions" in errors["too_few"]
    assert "returned nan for completion 0" in errors["not_finite"]
    assert "returned str" in errors["words"] and "one float per completion" in errors["words"]
    assert "1 reward weight(s) for the 2 reward function(s) of grpo.rewards" in errors["weights"]
    assert all("\n" not in message for message in errors.values())


@pytest.mark.slow  # over 15 s: the full suite's (the fast tier keeps within 5 minutes)
def test_the_group_model_holds_no_second_copy_under_lora_and_its_loss_is_the_token_mean():
    out = run_command([sys.executable, "tests/helpers/grpo_model_probe.py"]).stdout
    got = json.loads(re.search(r"^GROUP (.*)$", out, re.M).group(1))
    assert got["shape"] == [8, 12, 2]
    assert got["policy_gap"] <= 1e-6 and got["reference_gap"] <= 1e-6, got  # the base, adapters off
    assert got["policy_vs_base"] > 1e-3, got  # ... which the trained adapters do change
    # Keras's weighted mean, with the run's sample weights, is each loss type's reduction.
    assert len(got["loss_gaps"]) == 7 and max(got["loss_gaps"].values()) <= 1e-6, got
    lora = got["lora"]  # the reference is the policy's own base: no weight of its own
    assert lora["weights"] == lora["policy_weights"] and lora["trainable"] == lora["factors"] > 0, lora
    full = got["full"]  # a full fine-tune: a frozen copy beside the policy
    assert full["weights"] == 2 * full["policy_weights"] and full["trainable"] == full["policy_weights"], full
    assert got["no_reference"] == {"shape": [8, 12, 1], "weights": full["policy_weights"]}, got


GRPO = "configs/grpo_stdlib.py"
# A run's log lines of steps and evaluations, without the sampler's throughput (a timing).
LOGGED = re.compile(r"(step \d+/40 \|.*)$", re.M)


def logged(output: str) -> list:
    return [re.sub(r" \| sampling_tokens_per_second [^|]*", "", line) for line in LOGGED.findall(output)]


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory, data_dir, grpo_warm_start):
    """(folder, output): the warm start (SFT, the suite's: conftest) in FOLDER/arithmetic_sft,
    where the GRPO config reads its preset from beside its own workdir, and the tiny GRPO run in
    FOLDER/grpo, with its completions logged."""
    folder = tmp_path_factory.mktemp("grpo")
    assert grpo_warm_start["code"] == 0, grpo_warm_start["output"]
    shutil.copytree(Path(grpo_warm_start["folder"]) / "arithmetic_sft", folder / "arithmetic_sft")
    output = train(f"{GRPO}:tiny", folder / "grpo", *GRPO_ARGS.format(data_dir=data_dir).split()).stdout
    return folder, output


GRPO_ARGS = "--config.data.data_dir={data_dir} --config.grpo.log_completions=True"


@pytest.mark.slow
def test_grpo_stdlib_raises_the_reward_on_a_mesh_resumes_the_same_and_its_adapter_loads_in_peft(
        grpo_runs, data_dir):
    """The example end to end: the warm start (SFT), then GRPO with LoRA on fsdp 2 x model 2.
    The mean evaluation reward rises; a run killed after its step-20 checkpoint samples the
    same completions and logs the same losses when resumed; the checkpoints hold the adapters
    alone; the evaluation job gives the run's reward; the PEFT adapter on transformers gives
    the run's logits."""
    folder, reference = grpo_runs
    args = GRPO_ARGS.format(data_dir=data_dir).split()
    assert "cluster: jax mesh data=1 x fsdp=2 x model=2" in reference, reference[-3000:]
    rewards = [float(r) for r in re.findall(r"\| val_reward (\S+)", reference)]
    # Six seeds gave step 0 a spread (std) of 0.007, and rises of 0.044 to 0.087 by step 40.
    assert len(rewards) == 3 and rewards[-1] >= rewards[0] + 0.03, reference[-3000:]
    for name in ("reward", "reward_std", "reward_correct", "reward_close", "kl", "clip_fraction",
                 "completion_length", "sampling_tokens_per_second", "loss"):
        assert re.search(rf"step 40/40 \|.* {name} -?\d", reference), name
    assert re.search(r"time: .*\| sampling \d.*\| rewards \d", reference), reference[-1500:]

    # LoRA: the checkpoint holds the factors and their optimizer state alone; the base (and
    # the reference, the base itself) is read from model.preset again.
    saved = weights(folder / "grpo", step=40)
    sizes = lambda group: sum(v.size for k, v in saved.items() if k.startswith(group) and v.ndim)
    factors = int(re.search(r"([\d,]+) of them trainable", reference).group(1).replace(",", ""))
    assert sizes("model_by_path/") == factors and sizes("optimizer_by_path/") == 2 * factors

    command = [sys.executable, "-m", "tpu_keras.train", f"--config={GRPO}:tiny",
               f"--workdir={folder / 'killed'}", *args]
    resumed = killed_after_checkpoint_then_resumed(command, step=20)
    assert resumed_step(resumed) == 20, resumed[-2000:]
    after = lambda out: [line for line in logged(out) if re.match(r"step [34]0/", line)]
    assert after(resumed) == after(reference) and len(after(resumed)) == 3, (resumed[-3000:], reference)
    for batch in range(20, 40):
        name = f"{batch:06d}-host0.jsonl"
        assert (folder / "killed" / "completions" / name).read_text() == \
            (folder / "grpo" / "completions" / name).read_text(), name
    assert_same_weights(folder / "killed", folder / "grpo", step=40)

    # The evaluation job samples and scores as the run's own evaluation did.
    evaluated = run_command([sys.executable, "-m", "tpu_keras.evaluate",
                             f"--workdir={folder / 'grpo'}"]).stdout
    again = float(re.search(r"^step 40 \|.* val_reward (\S+)", evaluated, re.M).group(1))
    assert again == pytest.approx(rewards[-1], abs=5e-4), (evaluated[-500:], rewards)

    out = run_command([sys.executable, "tests/helpers/grpo_peft_probe.py", str(folder / "grpo")]).stdout
    got = json.loads(re.search(r"^PEFT (.*)$", out, re.M).group(1))
    assert got["step"] == 40 and got["gap"] <= 1e-4 and got["adapter_moves_logits"] > 1e-2, got


@pytest.mark.slow
def test_grpo_on_two_hosts_samples_scores_and_trains_as_one_host_does(grpo_runs, data_dir):
    """The tiny run again over two processes of two devices each (the same fsdp 2 x model 2
    mesh): each host samples and scores its own prompts' groups, and every logged figure
    (rewards, loss, KL, gradient norm, evaluations) equals the one-process run's, to the digits
    printed."""
    folder, reference = grpo_runs
    out = run_command([sys.executable, "-m", "tpu_keras.launch", "--hosts=2", "--devices_per_host=2",
                       "--timeout=500", "--", sys.executable, "-m", "tpu_keras.train",
                       f"--config={GRPO}:tiny", f"--workdir={folder / 'two_hosts'}",
                       "--config.cluster.virtual_devices=0", f"--config.data.data_dir={data_dir}"],
                      timeout=600).stdout
    assert "over 2 process(es)" in out, out[-3000:]
    host0 = logged("\n".join(line for line in out.splitlines() if line.startswith("[host 0]")))
    assert len(host0) == 7 and len(logged(reference)) == 7, (host0, logged(reference))
    # To the printed precision (4 significant digits): two hosts sum a figure across hosts in
    # another order than one process, so a value on a rounding boundary may print one last
    # digit apart (val_reward 0.078125 as 0.07812 and 0.07813).
    for ours, theirs in zip(host0, logged(reference)):
        assert ours.split(" |")[0] == theirs.split(" |")[0], (ours, theirs)  # 'step 10/40'
        assert figures(ours).keys() == figures(theirs).keys(), (ours, theirs)
        for name, value in figures(ours).items():
            assert value == pytest.approx(figures(theirs)[name], rel=1e-3, abs=1e-9), (name, ours, theirs)


def figures(line: str) -> dict:
    """{name: value} of a logged line's figures ('step 10/40 | loss 0.1234 | ...')."""
    return {name: float(value.replace(",", ""))
            for name, value in re.findall(r"\| (\w+) (-?[\d.,]+(?:e[-+]?\d+)?)", line)}


GPT_GRPO = """import sys
sys.path.insert(0, 'configs')
import lm_stdlib


def get_config(arg=None):
    config = lm_stdlib.get_config('tiny')
    config.engine = 'jax'
    config.data.tfds.name, config.data.preprocess = '', ''
    config.data.prompts.update(files={sums!r}, eval_files={sums!r})
    config.model.context_length = 16
    config.grpo.update(num_generations=4, max_completion_length=6, rewards=({rewards!r},),
                       beta=0.04, num_iterations=2, loss_type='grpo', top_p=0.9, stop=' ',
                       log_completions=True)
    config.train.update(batch_size=8, steps=4, eval_every=4, steps_per_execution=0)
    config.checkpoint.every_steps, config.log.every_steps = 4, 2
    return config
"""


def gpt_grpo_config(folder) -> str:
    """GPT_GRPO written to FOLDER/gpt_grpo.py, with its sums and its reward function beside it."""
    (folder / "sums.jsonl").write_text("".join(f'{{"prompt": "{a}+{a}=", "answer": "{2 * a}"}}\n'
                                                 for a in range(8)))
    (folder / "rewards.py").write_text(
        "def digits(prompts, completions, answer, **fields):\n"
        "    return [sum(c.isdigit() for c in text) for text in completions]\n")
    (folder / "gpt_grpo.py").write_text(GPT_GRPO.format(sums=str(folder / "sums.jsonl"),
                                                          rewards=f"{folder / 'rewards.py'}:digits"))
    return str(folder / "gpt_grpo.py")


@pytest.mark.slow  # over 15 s: the full suite's (the fast tier keeps within 5 minutes)
def test_grpo_on_the_gpt_builder_a_full_fine_tune_against_a_frozen_copy(tmp_path):
    """The gpt builder (no KV cache: the sampler reads the whole sequence), a full fine-tune
    with beta > 0 (a frozen copy is the reference), two updates per batch of samples (the
    sampling policy's log-probabilities computed first), TRL's 'grpo' loss type, top-p and a
    stop token; steps 3-4 profiled (the outer loop's profile, as a fit run's)."""
    out = train(gpt_grpo_config(tmp_path), tmp_path / "run",
                "--config.log.profile_steps=(3, 4)").stdout
    assert re.search(r"profiling from step 3 into \S+tensorboard", out), out[-3000:]
    traces = glob.glob(str(tmp_path / "run" / "tensorboard" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert traces and all(os.path.getsize(t) > 0 for t in traces), traces
    assert "GRPO reference: a frozen copy of the model's" in out, out[-3000:]
    for step in (2, 4):  # two updates per batch: the second's ratio moves off 1
        assert re.search(rf"step {step}/4 \| clip_fraction \S+ \| grad_norm \S+ \| kl \S+ \| "
                         r"loss -?\d", out), out[-3000:]
    assert re.search(r"step 4/4 \| val_reward \d", out), out[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "completions" / "000001-host0.jsonl")
             .read_text().splitlines()]
    assert len(lines) == 8 and {line["prompt"] for line in lines} <= {f"{a}+{a}=" for a in range(8)}
    assert not any(" " in line["completion"] for line in lines)  # grpo.stop ends a completion
    assert all(abs(sum(line["advantage"] for line in lines[g:g + 4])) < 1e-4 for g in (0, 4))
