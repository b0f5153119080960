"""Two local hosts: one dies mid-run, the other stops on its own, and a rerun resumes exactly."""

import os
import random
import re
import signal
import sys
import time

from conftest import run
from resume import (ARGS, DIGITS, STEPS, assert_same_weights, example_ids, finish,
                              read_until, resumed_step, seen_over_the_run, start)


def launch_args(workdir, data_dir, *launcher_flags):
    return [sys.executable, "-m", "tpu_keras.launch", "--hosts=2", "--timeout=400",
            *launcher_flags, "--", sys.executable, "-m", "tpu_keras.train", f"--config={DIGITS}",
            f"--workdir={workdir}", f"--config.data.data_dir={data_dir}", *ARGS]


def test_a_dead_host_stops_the_run_in_bounded_time_and_a_rerun_resumes_exactly(
        tmp_path_factory, data_dir):
    reference = tmp_path_factory.mktemp("two_hosts_reference")
    run(launch_args(reference, data_dir), timeout=450)
    workdir = tmp_path_factory.mktemp("two_hosts_killed")

    launcher = start(launch_args(workdir, data_dir, "--failure_grace=150"))
    try:
        started = "".join(read_until(launcher, r"hosts started: "))
        host1 = int(re.search(r"host 1 pid (\d+)", started).group(1))
        read_until(launcher, rf"\[host 0\].*step {random.choice([10, 20, 30])}/{STEPS}")
        time.sleep(random.uniform(0, 0.5))
        killed_at = time.monotonic()
        os.kill(host1, signal.SIGKILL)  # a PID the launcher reported as its own child
        output = finish(launcher, timeout=200)
        stopped_after = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode != 0
    assert "host 1 failed first, with signal 9 (SIGKILL)" in output, output[-3000:]
    assert "host 0 stopped on its own" in output, output[-3000:]
    assert re.search(r"\[host 0\] error: lost contact with another host", output), output[-3000:]
    assert stopped_after < 120, stopped_after

    (workdir / "example_ids").rename(workdir / "example_ids.first")
    second = run(launch_args(workdir, data_dir), timeout=450).stdout
    resumed_at = resumed_step(second)
    assert_same_weights(workdir, reference)
    seen = seen_over_the_run(example_ids(workdir / "example_ids.first"),
                             example_ids(workdir / "example_ids"), resumed_at)
    reference_ids = example_ids(reference / "example_ids")
    assert sorted(reference_ids) == [(h, p) for h in (0, 1) for p in range(STEPS)]
    assert seen == reference_ids
