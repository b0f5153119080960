"""Simulated multislice pods on the jax engine, in the TPU's own chip order.

Two v4-16 slices (2 hosts of 4 chips each) train like one device on the same
global batches. On that pod, with the MLP's hidden units split over a model
axis, when a host of one slice dies, the three others (its own slice's and
the other slice's) stop by themselves within bounded time, and the rerun
resumes exactly from the last checkpoint. (The one kill test of a
jax pod: each simulated host costs a start of TensorFlow and JAX and a
compile, so the slices and the hosts-per-slice are checked in one run.)
"""

import pytest

from pods import a_host_killed_then_the_run_resumed, assert_trains_like_one_device, probe, train_on_a_pod

pytestmark = pytest.mark.slow  # every check here starts several hosts or runs


def test_two_v4_slices_in_the_tpu_chip_order_train_like_one_device(tmp_path):
    [one] = probe("digits", init=tmp_path / "init.npz")
    hosts = probe("digits", "--tpu=2xv4-16", init=tmp_path / "init.npz")
    assert [r["host"] for r in hosts] == [0, 1, 2, 3]
    for report in hosts:
        assert report["mesh"] == {"slices": 2, "data": 4, "fsdp": 2, "expert": 1, "context": 1, "model": 1}
        assert report["slice"] == report["host"] // 2  # each host in the slice the launcher told it
        # Slices on the outer data axis (rows 0-3 slice 0's hosts, 4-7 slice 1's); inside a
        # slice the chip torus alternates its two hosts along the data axis.
        assert report["rows"] == [{"slice": r // 4, "processes": [2 * (r // 4) + r % 2]} for r in range(8)]
        # Weights split over fsdp (inside a slice), never over data (across slices).
        axes = {a for spec in report["specs"].values() for a in spec if a}
        assert "fsdp" in axes and "data" not in axes, report["specs"]
    assert [r["batch_rows"] for r in hosts] == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    assert_trains_like_one_device(one, hosts)


def test_a_dead_host_stops_every_slice_and_the_rerun_resumes_exactly(tmp_path, data_dir):
    # 20 steps, a checkpoint at 10, host 3 (slice 1) killed after step 15: steps 11-15 run twice.
    # The MLP's hidden units split over a model axis: a hybrid mesh of four processes.
    command = train_on_a_pod(("--tpu=2xv4-16",), tmp_path, "configs/digits.py:tiny",
                             f"--config.data.data_dir={data_dir}", "--config.mesh.slices=2",
                             "--config.mesh.model=2", steps=20, every=10)
    seen, rerun = a_host_killed_then_the_run_resumed(command, tmp_path, 4, killed=3,
                                                     slice_of=lambda host: host // 2, steps=20, every=10)
    assert "jax mesh slices=2 x data=4 x model=2 over 4 process(es)" in rerun, rerun[-3000:]
    examples = [i for ids in seen.values() for i in ids]
    assert len(examples) == len(set(examples)) == 20 * 64  # 20 steps of 64 images, none twice
