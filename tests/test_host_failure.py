"""Two local hosts: one dies mid-run, the other stops on its own, and a rerun resumes exactly.

The reference run is on the launcher's private network (the default) and the
killed one on the host's (`--network=host`): nothing outside reaches the
first one's servers, the second one's are reachable, and both end with the
same weights. Where the kernel refuses a namespace, the rest still runs, and
the test then skips to say the private network went unchecked.
"""

import os
import random
import re
import signal
import sys
import time

import pytest

from conftest import NO_PRIVATE_NETWORK, reachable, run_command, skip_without_private_network
from resume import (ARGS, DIGITS, STEPS, assert_same_weights, example_ids, finish,
                    read_until, resumed_step, running, seen_over_the_run)
from test_evaluate import assert_same_validation

pytestmark = pytest.mark.slow  # every check here starts several hosts or runs


def launch_args(workdir, data_dir, *launcher_flags):
    return [sys.executable, "-m", "tpu_keras.launch", "--hosts=2", "--timeout=400",
            *launcher_flags, "--", sys.executable, "-m", "tpu_keras.train", f"--config={DIGITS}",
            f"--workdir={workdir}", f"--config.data.data_dir={data_dir}", *ARGS]


def listening_ports(pid):
    """The TCP ports process `pid` listens on, from its network namespace's own socket table."""
    sockets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            sockets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as rows:
            for row in list(rows)[1:]:
                fields = row.split()  # local address, ..., state (0A: LISTEN), ..., inode
                if fields[3] == "0A" and f"socket:[{fields[9]}]" in sockets:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def host_pids(lines):
    return [int(pid) for pid in re.findall(r"host \d+ pid (\d+)", "".join(lines))]


def test_a_dead_host_stops_the_run_in_bounded_time_and_a_rerun_resumes_exactly(
        tmp_path_factory, data_dir):
    reference = tmp_path_factory.mktemp("two_hosts_reference")
    # An evaluation job follows the reference run (all of whose checkpoints are kept).
    with running(launch_args(reference, data_dir) + ["--config.checkpoint.keep=5"]) as launcher:
        started = "".join(read_until(launcher, r"hosts started: "))
        deadline = time.monotonic() + 200
        while not (reference / "config.json").exists():
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        with running([sys.executable, "-m", "tpu_keras.evaluate", f"--workdir={reference}",
                      "--watch", "--poll_seconds=0.5"]) as watcher:
            read_until(launcher, rf"\[host 0\].*step 10/{STEPS}")
            listening = {pid: listening_ports(pid) for pid in host_pids(started)}
            in_reach = {port: reachable(port) for ports in listening.values() for port in ports}
            output = finish(launcher, timeout=300)
            evaluated = finish(watcher, timeout=200)
    assert launcher.returncode == 0, output[-3000:]
    assert watcher.returncode == 0, evaluated[-3000:]
    assert re.findall(r"^step (\d+) \|", evaluated, re.M) == ["10", "20", "30", "40"], evaluated[-3000:]
    assert_same_validation(reference, [10, 20, 30, 40])
    assert len(listening) == 2 and all(listening.values()), listening  # each its TF worker server
    private = NO_PRIVATE_NETWORK not in started
    if private:
        assert not any(in_reach.values()), in_reach
    workdir = tmp_path_factory.mktemp("two_hosts_killed")

    with running(launch_args(workdir, data_dir, "--failure_grace=150", "--network=host")) as launcher:
        host1 = host_pids(read_until(launcher, r"hosts started: "))[1]
        read_until(launcher, rf"\[host 0\].*step {random.choice([10, 20, 30])}/{STEPS}")
        host1_ports = listening_ports(host1)
        assert host1_ports and all(reachable(port) for port in host1_ports), host1_ports
        time.sleep(random.uniform(0, 0.5))
        killed_at = time.monotonic()
        os.kill(host1, signal.SIGKILL)  # a PID the launcher reported as its own child
        output = finish(launcher, timeout=200)
        stopped_after = time.monotonic() - killed_at
    assert launcher.returncode != 0
    assert "host 1 failed first, with signal 9 (SIGKILL)" in output, output[-3000:]
    assert "host 0 stopped on its own" in output, output[-3000:]
    assert re.search(r"\[host 0\] error: lost contact with another host", output), output[-3000:]
    assert stopped_after < 120, stopped_after

    (workdir / "example_ids").rename(workdir / "example_ids.first")
    second = run_command(launch_args(workdir, data_dir, "--network=host"), timeout=450).stdout
    resumed_at = resumed_step(second)
    assert_same_weights(workdir, reference)
    seen = seen_over_the_run(example_ids(workdir / "example_ids.first"),
                             example_ids(workdir / "example_ids"), resumed_at)
    reference_ids = example_ids(reference / "example_ids")
    assert sorted(reference_ids) == [(h, p) for h in (0, 1) for p in range(STEPS)]
    assert seen == reference_ids
    if not private:  # the failure and the resume hold without a namespace; say what went unchecked
        skip_without_private_network(started)


def assert_survivor_stops_by_itself(args, kill_after: str):
    """Kills host 1 of the 2-host launch `args` once host 0 logs `kill_after`: host 0 names
    the lost host in one line and stops on its own within 5 s (the grace is 60 s)."""
    with running(args) as launcher:
        host1 = host_pids(read_until(launcher, r"hosts started: "))[1]
        read_until(launcher, kill_after)
        killed_at = time.monotonic()
        os.kill(host1, signal.SIGKILL)  # a PID the launcher reported as its own child
        output = finish(launcher, timeout=120)
        stopped_after = time.monotonic() - killed_at
    assert "host 1 failed first, with signal 9 (SIGKILL)" in output, output[-3000:]
    assert "host 0 stopped on its own, with exit code 2" in output, output[-3000:]
    assert re.search(r"\[host 0\] error: lost contact with another host after step \d+", output), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert stopped_after < 5, stopped_after  # the grace is 60 s: the survivor stopped itself


def test_a_jax_host_killed_while_a_save_is_in_flight_ends_its_survivor_by_itself(tmp_path, data_dir):
    """Killed as the other host enters the save of step 50 (Orbax's barrier first, then the
    background write): the survivor names the lost host in one line and stops on its own,
    long before the launcher's grace (60 s) would stop it. Before, Orbax's barrier raised a
    ValueError the loop took for a failure of its own, and it waited for the save in flight,
    which waits on the lost host. Measured here: 0.3 s from the kill to the launch's end."""
    args = [sys.executable, "-m", "tpu_keras.launch", "--hosts=2", "--timeout=300", "--failure_grace=60",
            "--", sys.executable, "-m", "tpu_keras.train", "--config=configs/lm_stdlib.py:tiny",
            f"--workdir={tmp_path / 'run'}", f"--config.data.data_dir={data_dir}", "--config.engine=jax",
            "--config.train.steps=1000", "--config.checkpoint.every_steps=50"]
    assert_survivor_stops_by_itself(args, r"\[host 0\].*step 50/1000")


def test_a_grpo_host_killed_ends_its_survivor_by_itself(tmp_path):
    """GRPO's sample-then-update runs in the same outer loop as fit: a host killed between
    two batches of samples (each host samples and scores its own groups) ends the launch
    within seconds, its survivor naming the lost host in one line, long before the grace."""
    from test_grpo import gpt_grpo_config
    args = [sys.executable, "-m", "tpu_keras.launch", "--hosts=2", "--timeout=300", "--failure_grace=60",
            "--", sys.executable, "-m", "tpu_keras.train", f"--config={gpt_grpo_config(tmp_path)}",
            f"--workdir={tmp_path / 'run'}", "--config.train.steps=1000",
            "--config.train.eval_every=1000", "--config.checkpoint.every_steps=4"]
    assert_survivor_stops_by_itself(args, r"\[host 0\].*step 4/1000")
