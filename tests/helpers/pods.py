"""What the simulated-pod tests share: the probe that trains like one device, and a run
whose host is killed mid-run and then resumed (`test_multislice`)."""

import glob
import json
import os
import re
import signal
import sys
import time

from conftest import run_command
from resume import STEPS, example_ids, finish, read_until, running, seen_over_the_run


def probe(name, *launcher, init):
    """`tests/helpers/pod_probe.py`'s reports, by host: one device, or each host of the launched pod."""
    command = [sys.executable, "tests/helpers/pod_probe.py", name, str(init)]
    if launcher:
        command = [sys.executable, "-m", "tpu_keras.launch", *launcher, "--timeout=400", "--", *command]
    out = run_command(command, timeout=450).stdout
    return sorted((json.loads(line) for line in re.findall(r"POD (\{.*\})", out)), key=lambda r: r["host"])


def assert_trains_like_one_device(one, hosts):
    """Every host's losses and update equal one device's (within 1e-5), and JAX put each
    host's examples in the rows `mesh.feed_rows` says."""
    for report in hosts:
        assert report["rows_agree"], report["batch_rows"]
        assert report["moved"] > 1e-3 and abs(report["moved"] - one["moved"]) <= 1e-5 * one["moved"]
        assert abs(report["weights_sum"] - one["weights_sum"]) <= 1e-5 * abs(one["weights_sum"])
        for step, (got, want) in enumerate(zip(report["losses"], one["losses"], strict=True)):
            assert abs(got - want) <= 1e-5, (step, report["losses"], one["losses"])


def train_on_a_pod(launcher, workdir, config, *overrides, steps=STEPS, every=STEPS // 2):
    """`python -m tpu_keras.launch LAUNCHER -- python -m tpu_keras.train` for `steps` steps on
    the jax engine, 5 per execution, a checkpoint every `every` and a validation at the end,
    logging the loss every 5 steps and every batch's example ids."""
    # The grace outlasts JAX's heartbeat timeout (100 s), the hosts' last way to notice a
    # lost peer when no collective fails first (a loaded 2-core machine once took over 60 s).
    return [sys.executable, "-m", "tpu_keras.launch", *launcher, "--timeout=500", "--failure_grace=150",
            "--", sys.executable, "-m", "tpu_keras.train", f"--config={config}",
            f"--workdir={workdir}", "--config.engine=jax", f"--config.train.steps={steps}",
            "--config.log.every_steps=5", "--config.train.steps_per_execution=5",
            f"--config.train.eval_every={steps}", f"--config.checkpoint.every_steps={every}",
            "--config.data.log_example_ids=True", *overrides]


def a_host_killed_then_the_run_resumed(command, workdir, hosts, *, killed, slice_of=None,
                                       steps=STEPS, every=STEPS // 2):
    """Runs `command` (a `train_on_a_pod` of `steps` steps, a checkpoint every `every`),
    SIGKILLs host `killed` once host 0 logs step `every + 10` (so the first checkpoint is
    saved and the second not reached), checks that every other host stops by itself within
    bounded time, then reruns it to the end and checks the resume was exact: each host
    resumed from that checkpoint with the same weights, the steps trained in both attempts
    gave the same losses bit for bit, on the same batches, and over the run every host fed
    every step once. Returns (every example id trained on, by (host, batch position); the
    rerun's output)."""
    killed_after = every + 10 if every + 10 < steps else every + 5
    assert killed_after < 2 * every and killed_after < steps

    def name(host):
        return f"host {host}" + (f" (slice {slice_of(host)})" if slice_of else "")

    with running(command) as launcher:
        started = "".join(read_until(launcher, r"hosts started: "))
        pids = {int(h): int(p) for h, p in re.findall(r"host (\d+) pid (\d+)", started)}
        where = f" (slice {slice_of(killed)})" if slice_of else ""
        assert f"host {killed} pid {pids[killed]}{where}" in started, started
        read_until(launcher, rf"\[host 0\].*step {killed_after}/{steps}", timeout=400)
        killed_at = time.monotonic()
        os.kill(pids[killed], signal.SIGKILL)  # a PID the launcher reported as its own child
        output = finish(launcher, timeout=200)
        stopped_after = time.monotonic() - killed_at
    assert launcher.returncode != 0
    assert f"{name(killed)} failed first, with signal 9 (SIGKILL)" in output, output[-3000:]
    # Every other host notices and ends by itself (the launcher would stop it after
    # --failure_grace), most with one line.
    for host in set(range(hosts)) - {killed}:
        assert f"{name(host)} stopped on its own" in output, output[-3000:]
    assert re.search(rf"\[host \d+\] error: lost contact with another host after step {killed_after}",
                     output), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert stopped_after < 150, stopped_after
    assert all(_gone(pid) for pid in pids.values()), pids

    (workdir / "example_ids").rename(workdir / "example_ids.first")
    second = run_command(command, timeout=560).stdout
    resumed = re.findall(r"\[host (\d+)\].*resumed from \S+ at step (\d+)", second)
    assert sorted(resumed) == sorted((str(h), str(every)) for h in range(hosts)), second[-3000:]
    fingerprints = dict(re.findall(r"\[host (\d+)\].*weights fingerprint: (\S+)", second))
    assert len(fingerprints) == hosts and len(set(fingerprints.values())) == 1, fingerprints
    # The steps after the checkpoint ran in both attempts: from the restored checkpoint, the
    # same losses, bit for bit (weights, optimizer state, random state and input position
    # all restored) ...
    first_losses, second_losses = logged_losses(workdir)
    again = list(range(every + 5, killed_after + 1, 5))
    assert set(range(5, killed_after + 1, 5)) <= set(first_losses), first_losses
    assert sorted(second_losses) == list(range(every + 5, steps + 1, 5)), second_losses
    assert [first_losses[s] for s in again] == [second_losses[s] for s in again]
    # ... on the same batches; and over the run every host fed every step once.
    seen = seen_over_the_run(example_ids(workdir / "example_ids.first", steps),
                             example_ids(workdir / "example_ids", steps), every)
    assert sorted(seen) == [(h, p) for h in range(hosts) for p in range(steps)]
    return seen, second


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
