"""A simulated multislice pod: 2 slices of 2 hosts of 2 fake devices, on the jax engine.

It trains like one device on the same global batches; when a host of one
slice dies, every host of every slice stops by itself within bounded time;
and the rerun resumes exactly from the last checkpoint.
"""

import glob
import json
import os
import re
import signal
import sys
import time

from conftest import run
from resume import example_ids, finish, read_until, running, seen_over_the_run

POD = ("--slices=2", "--hosts=2", "--devices_per_host=2")
STEPS = 40  # the example logs' length that resume.example_ids reads


def probe(*launcher, init):
    command = [sys.executable, "tests/slice_probe.py", str(init)]
    if launcher:
        command = [sys.executable, "-m", "tpu_keras.launch", *launcher, "--timeout=400", "--", *command]
    out = run(command, timeout=450).stdout
    return [json.loads(line) for line in re.findall(r"SLICES (\{.*\})", out)]


def test_a_two_slice_pod_trains_like_one_device(tmp_path):
    [one] = probe(init=tmp_path / "init.npz")
    hosts = sorted(probe(*POD, init=tmp_path / "init.npz"), key=lambda r: r["host"])
    assert [r["host"] for r in hosts] == [0, 1, 2, 3]
    for report in hosts:
        assert report["mesh"] == {"slices": 2, "data": 2, "fsdp": 2, "model": 1}
        # Slices on the outer data axis: rows 0-1 are slice 0's hosts, rows 2-3 slice 1's,
        # and each host is in the slice the launcher told it.
        assert report["rows"] == [{"slice": s, "processes": [p]} for s, p in ((0, 0), (0, 1), (1, 2), (1, 3))]
        assert report["slice"] == report["host"] // 2
        # Weights split over fsdp (inside a slice), never over data (across slices).
        axes = {a for spec in report["specs"].values() for a in spec if a}
        assert "fsdp" in axes and "data" not in axes, report["specs"]
        assert report["moved"] > 1e-3 and abs(report["moved"] - one["moved"]) <= 1e-5 * one["moved"]
        assert abs(report["weights_sum"] - one["weights_sum"]) <= 1e-5 * abs(one["weights_sum"])
        for step, (got, want) in enumerate(zip(report["losses"], one["losses"], strict=True)):
            assert abs(got - want) <= 1e-5, (step, report["losses"], one["losses"])


def train_on_the_pod(workdir, data_dir):
    return [sys.executable, "-m", "tpu_keras.launch", *POD, "--timeout=500", "--failure_grace=60", "--",
            sys.executable, "-m", "tpu_keras.train", "--config=configs/digits.py:tiny",
            f"--workdir={workdir}", f"--config.data.data_dir={data_dir}", "--config.engine=jax",
            "--config.mesh.slices=2", f"--config.train.steps={STEPS}", "--config.log.every_steps=5",
            "--config.train.steps_per_execution=5", "--config.train.eval_every=20",
            "--config.checkpoint.every_steps=20", "--config.data.log_example_ids=True"]


def logged_losses(workdir):
    """{step: interval loss} from each TensorBoard event file the chief wrote, oldest first."""
    import tensorflow as tf
    files = sorted(glob.glob(str(workdir / "tensorboard" / "events.out.tfevents.*")), key=os.path.getmtime)
    return [{event.step: float(tf.make_ndarray(value.tensor))
             for event in tf.compat.v1.train.summary_iterator(path)
             for value in event.summary.value if value.tag == "loss"} for path in files]


def _gone(pid):
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_a_dead_host_stops_every_slice_and_the_rerun_resumes_exactly(tmp_path, data_dir):
    with running(train_on_the_pod(tmp_path, data_dir)) as launcher:
        started = "".join(read_until(launcher, r"hosts started: "))
        pids = {int(h): int(p) for h, p in re.findall(r"host (\d+) pid (\d+)", started)}
        assert "host 3 pid %d (slice 1)" % pids[3] in started, started
        read_until(launcher, rf"\[host 0\].*step 30/{STEPS}", timeout=400)  # checkpoint 20 saved
        killed_at = time.monotonic()
        os.kill(pids[3], signal.SIGKILL)  # a PID the launcher reported as its own child
        output = finish(launcher, timeout=200)
        stopped_after = time.monotonic() - killed_at
    assert launcher.returncode != 0
    assert "host 3 (slice 1) failed first, with signal 9 (SIGKILL)" in output, output[-3000:]
    # Every other host, of both slices, notices and ends by itself (the launcher would
    # stop it after --failure_grace), most with one line.
    for host in range(3):
        assert f"host {host} (slice {host // 2}) stopped on its own" in output, output[-3000:]
    assert re.search(r"\[host \d\] error: lost contact with another host after step 30", output), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert stopped_after < 120, stopped_after
    assert all(_gone(pid) for pid in pids.values()), pids

    (tmp_path / "example_ids").rename(tmp_path / "example_ids.first")
    second = run(train_on_the_pod(tmp_path, data_dir), timeout=560).stdout
    resumed = re.findall(r"\[host (\d)\].*resumed from \S+ at step (\d+)", second)
    assert sorted(resumed) == [(str(h), "20") for h in range(4)], second[-3000:]
    fingerprints = dict(re.findall(r"\[host (\d)\].*weights fingerprint: (\S+)", second))
    assert len(fingerprints) == 4 and len(set(fingerprints.values())) == 1, fingerprints
    # Steps 21-30 ran in both attempts: from the restored checkpoint, the same losses, bit
    # for bit (weights, optimizer state, random state and input position all restored) ...
    first_losses, second_losses = logged_losses(tmp_path)
    assert {5, 10, 15, 20, 25, 30} <= set(first_losses), first_losses
    assert sorted(second_losses) == [25, 30, 35, 40], second_losses
    assert [first_losses[s] for s in (25, 30)] == [second_losses[s] for s in (25, 30)]
    # ... on the same batches; and over the run every host fed every step once.
    seen = seen_over_the_run(example_ids(tmp_path / "example_ids.first"),
                             example_ids(tmp_path / "example_ids"), 20)
    assert sorted(seen) == [(h, p) for h in range(4) for p in range(STEPS)]
