"""A simulated v5litepod-16 in the TPU's own chip order: `launch --tpu=v5litepod-16` starts
4 hosts of 4 CPU devices, each standing for the chip of its host and place in libtpu's
description of the slice, so the jax engine's default mesh (data=16) gives host 0 the
batch rows 0, 1, 6 and 15, as on the real slice.

The byte-level GPT of `configs/lm_stdlib.py:tiny` trains there like one device on the
same global batches. (A host killed mid-run, on a pod of four hosts in two slices, is
test_multislice.py's.)
"""

import pytest

from pods import assert_trains_like_one_device, probe


@pytest.mark.slow
def test_the_default_mesh_on_a_v5litepod_16_trains_like_one_device(tmp_path):
    [one] = probe("lm", init=tmp_path / "init.npz")
    hosts = probe("lm", "--tpu=v5litepod-16", init=tmp_path / "init.npz")
    assert [r["host"] for r in hosts] == [0, 1, 2, 3]
    assert all(r["mesh"] == {"slices": 1, "data": 16, "fsdp": 1, "expert": 1, "context": 1, "model": 1} for r in hosts)
    assert [r["batch_rows"] for r in hosts] == [[0, 1, 6, 15], [2, 3, 4, 5], [7, 12, 13, 14], [8, 9, 10, 11]]
    assert [r["pipelines"] for r in hosts] == [[4, i] for i in range(4)]
    assert_trains_like_one_device(one, hosts)

