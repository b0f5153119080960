"""A run loses nothing: exact resume after kill -9 and SIGTERM, atomic saves, and each
weight restored under its own name.

A resumed run must end with the same weights (max abs difference <= 1e-6)
as a run that went through, having trained on the same examples (see
`resume` for the runs and how their example ids are compared).
"""

import glob
import json
import os
import random
import re
import shutil
import signal
import sys
import time

import pytest

from conftest import run_command, train
from resume import (ARGS, DIGITS, STEPS, assert_same_weights, example_ids, finish, read_until,
                    resumed_step, seen_over_the_run, start, train_args)


_ENGINE = {"tf": (), "jax": ("--config.engine=jax",)}


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_dir):
    """The uninterrupted run on an engine: engine -> (workdir, {position: ids}, output)."""
    made = {}

    def reference_on(engine):
        if engine not in made:
            workdir = tmp_path_factory.mktemp(f"reference_{engine}")
            output = train(DIGITS, workdir, f"--config.data.data_dir={data_dir}", *ARGS,
                           *_ENGINE[engine]).stdout
            ids = example_ids(workdir / "example_ids")
            assert sorted(ids) == [(0, position) for position in range(STEPS)]
            made[engine] = workdir, ids, output
        return made[engine]
    return reference_on


@pytest.fixture
def reference(references):
    return references("tf")


def interrupted_then_resumed(workdir, data_dir, interrupt, *extra, slow_commits=False, env=None):
    """Starts a run (with `extra` arguments), lets `interrupt(process)` stop it, then resumes
    it to the end.

    With `slow_commits` the first attempt waits between writing each
    checkpoint and committing it (`slow_commit.py`, `env` its settings).
    Returns (first attempt's output, second attempt's output).
    """
    args = train_args(workdir, data_dir, *extra)
    if slow_commits:
        args = [args[0], "tests/helpers/slow_commit.py", *args[3:]]
    first = start(args, **(env or {}))
    try:
        first_output = interrupt(first)
    finally:
        if first.poll() is None:
            first.kill()
        first.wait()
    os.rename(workdir / "example_ids", workdir / "example_ids.first")
    second = train(DIGITS, workdir, f"--config.data.data_dir={data_dir}", *ARGS, *extra)
    return first_output, second.stdout


def assert_resumed_exactly(workdir, reference, resumed_at):
    """The same final weights as the reference, and the same examples at every step."""
    assert_same_weights(workdir, reference[0])
    seen = seen_over_the_run(example_ids(workdir / "example_ids.first"),
                             example_ids(workdir / "example_ids"), resumed_at)
    assert seen == reference[1]


@pytest.mark.slow
def test_kill_9_at_a_random_step_resumes_exactly(reference, tmp_path, data_dir):
    boundary = random.choice([10, 20, 30])
    delay = random.uniform(0, 0.5)

    def kill(process):
        lines = read_until(process, rf"step {boundary}/{STEPS}")
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        return "".join(lines)

    _, output = interrupted_then_resumed(tmp_path, data_dir, kill)
    resumed_at = resumed_step(output)
    assert resumed_at >= boundary - 10, output[-2000:]
    assert_resumed_exactly(tmp_path, reference, resumed_at)


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_exits_42_and_resumes_exactly(reference, tmp_path, data_dir):
    def terminate(process):
        lines = read_until(process, rf"step 10/{STEPS}")
        time.sleep(random.uniform(0, 0.1))  # well before step 40
        process.send_signal(signal.SIGTERM)
        rest = finish(process)
        assert process.returncode == 42, rest[-2000:]
        return "".join(lines) + rest

    first_output, output = interrupted_then_resumed(tmp_path, data_dir, terminate)
    saved = int(re.search(r"saved a checkpoint at step (\d+) after SIGTERM", first_output).group(1))
    assert saved % 2 == 0 and 10 < saved < STEPS, first_output[-2000:]  # a host-call boundary
    assert resumed_step(output) == saved
    # The log stays on its grid: a mid-interval resume first finishes the interval.
    next_line = -(-(saved + 1) // 10) * 10
    assert re.findall(rf"step (\d+)/{STEPS} \|", output) == [str(s) for s in range(next_line, STEPS + 1, 10)]
    assert_resumed_exactly(tmp_path, reference, saved)


@pytest.mark.slow
def test_a_kill_during_a_synchronous_save_leaves_the_previous_checkpoint_loadable(
        reference, tmp_path, data_dir):
    def kill_mid_save(process):
        # Each save waits 3 s between writing its files and committing them (slow_commit.py).
        read_until(process, r"saved checkpoint \S+ckpt-10")
        deadline = time.time() + 120
        while not (tmp_path / "checkpoints" / "ckpt-20.index").exists():
            assert process.poll() is None and time.time() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        return ""

    _, output = interrupted_then_resumed(tmp_path, data_dir, kill_mid_save,
                                         "--config.checkpoint.asynchronous=False", slow_commits=True)
    assert resumed_step(output) == 10, output[-2000:]
    assert_resumed_exactly(tmp_path, reference, 10)


def _losses(output):
    """{step: the loss its log line printed}."""
    return dict(re.findall(rf"step (\d+)/{STEPS} \|.*? loss ([\d.e+-]+)", output))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["tf", "jax"])
def test_a_kill_9_while_a_save_writes_in_the_background_resumes_exactly(
        engine, references, tmp_path, data_dir):
    reference = references(engine)

    def kill_while_writing(process):
        # Step 20's save stays unwritten for two minutes (slow_commit.py): the loop goes on,
        # and the save of step 30 waits for it; then the run is killed.
        lines = read_until(process, r"checkpoint of step 30: waiting for step 20's, still being written")
        process.send_signal(signal.SIGKILL)
        return "".join(lines)

    first_output, output = interrupted_then_resumed(
        tmp_path, data_dir, kill_while_writing, *_ENGINE[engine], slow_commits=True,
        env={"SLOW_COMMIT_STEP": "20", "SLOW_COMMIT_SECONDS": "120"})
    assert re.search(rf"step 30/{STEPS} \|", first_output), first_output[-2000:]
    assert not re.search(r"saved checkpoint \S*(ckpt-|/)20\b", first_output), first_output[-2000:]
    assert resumed_step(output) == 10, output[-2000:]
    assert_resumed_exactly(tmp_path, reference, 10)
    resumed, uninterrupted = _losses(output), _losses(reference[2])
    assert sorted(resumed) == ["20", "30", "40"] and resumed == {s: uninterrupted[s] for s in resumed}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["tf", "jax"])
def test_a_run_exits_only_once_its_last_save_is_committed(engine, tmp_path, data_dir):
    args = train_args(tmp_path, data_dir, *_ENGINE[engine])
    output = run_command([args[0], "tests/helpers/slow_commit.py", *args[3:]],
                         env={"SLOW_COMMIT_STEP": str(STEPS), "SLOW_COMMIT_SECONDS": "5"}).stdout
    saved = re.search(rf"saved checkpoint \S*(ckpt-|/){STEPS}\n", output)
    time_line = re.search(r"checkpoints [\d.]+ \(\+[\d.]+ written in the background, ([\d.]+) of "
                          r"the blocked time waiting for a write\)", output)
    assert saved and time_line and saved.start() < time_line.start(), output[-3000:]
    assert float(time_line.group(1)) >= 4.0, time_line.group(0)  # the 5 s the write was held
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert timings["background"]["checkpoint_writes"] >= 5.0, timings
    assert resumed_step(train(DIGITS, tmp_path, f"--config.data.data_dir={data_dir}", *ARGS,
                              *_ENGINE[engine]).stdout) == STEPS


def test_an_unreadable_latest_checkpoint_falls_back_to_the_one_before(reference, tmp_path, data_dir):
    shutil.copytree(reference[0] / "checkpoints", tmp_path / "checkpoints")
    latest = glob.glob(str(tmp_path / "checkpoints" / f"ckpt-{STEPS}.data-*"))[0]
    with open(latest, "r+b") as f:
        f.truncate(100)
    output = train(DIGITS, tmp_path, f"--config.data.data_dir={data_dir}", *ARGS).stdout
    assert re.search(rf"ckpt-{STEPS} is unreadable .*trying the one before it", output), output[-2000:]
    assert resumed_step(output) == 30
    assert_same_weights(tmp_path, reference[0])


@pytest.mark.parametrize("engine", ["tf", pytest.param("jax", marks=pytest.mark.slow)])
def test_a_checkpoint_restores_each_weight_by_name_and_names_what_does_not_fit(engine, tmp_path):
    # One process per engine (tests/helpers/checkpoint_probe.py): a layer that creates query and key
    # in the other order, models that do not fit, a checkpoint stored by position, and a
    # LoRA run's checkpoints of what trains alone.
    out = run_command([sys.executable, "tests/helpers/checkpoint_probe.py", engine, str(tmp_path)]).stdout
    tags = ("SWAPPED", "WIDER", "EXTRA", "OLD", "ADAPTERS")
    r = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
         if line.split(" ", 1)[0] in tags}
    assert set(r) == set(tags), out[-3000:]
    swapped = r["SWAPPED"]
    assert swapped["saved_order"][:2] == ["probe/attention/query", "probe/attention/key"], swapped
    assert swapped["loaded_order"][:2] == ["probe/attention/key", "probe/attention/query"], swapped
    # Every weight and optimizer slot has the saved value of its own name; by position the
    # query and the key would have swapped.
    assert swapped["step"] == 4 and swapped["names"] and swapped["apart"] == 0.0, swapped
    assert swapped["by_position_apart"] > 0.1 and swapped["predictions_apart"] <= 1e-6, swapped
    for error, fragment in ((r["WIDER"], "weight 'probe/attention/query' is [4, 4] in the checkpoint "
                                         "and [4, 8] in this model (and 2 more differences)"),
                            (r["EXTRA"], "weight 'probe/extra/kernel' [4, 4] of this model is not "
                                         "in the checkpoint")):
        assert error and "\n" not in error and "does not fit this model: " + fragment in error, error
        assert error.endswith("use a new --workdir for a different model"), error
    assert r["OLD"] == {"step": 4, "apart": 0.0}, r["OLD"]
    assert "stores its variables by position (written before checkpoints named them)" in out
    # With `attention` frozen, the checkpoint holds what trains (the head, its optimizer
    # slots) and the random state: restored over a zeroed base, the base stays zero. A
    # checkpoint of every weight, from before, restores too.
    adapters = r["ADAPTERS"]
    assert adapters["model"] == ["probe/head/bias", "probe/head/kernel", "random_state/0"], adapters
    assert adapters["optimizer"] == 6, adapters  # iteration, learning rate, two moments of two
    assert adapters["zeroed_base"] == adapters["head_apart"] == adapters["intact_apart"] == 0.0, adapters
    assert adapters["whole_step"] == 4 and adapters["whole_apart"] == 0.0, adapters
