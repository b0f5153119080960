"""Context parallelism (`mesh.context`, tpu_keras/models/context_attention.py): the tiny Llama
trained with its sequences split over devices takes the steps it takes on one device, on plain
text and on instruction pairs packed apart; its attention gathers the keys and values; the
TPU's fused kernel on a split sequence computes keras-hub's attention; with a model axis beside
context, `layout.sequence_parallel` splits the blocks' outputs along the sequence and takes the
same steps (tests/helpers/context_probe.py).
Its bad inputs: tests/test_errors.py and tests/test_mesh_and_rules.py."""

import json
import re
import sys

import pytest

from conftest import run_command


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_split_sequence_trains_as_on_one_device_and_gathers_keys_and_values(data_dir):
    out = run_command([sys.executable, "tests/helpers/context_probe.py", data_dir], timeout=900).stdout
    got = json.loads(re.search(r"^CONTEXT (.*)$", out, re.M).group(1))
    for kind in ("text", "instructions"):
        one = got[kind]["one"]["losses"]
        for mesh in ("fsdp2_context2", "context4", "context2_model2", "context2_model2_sequence"):
            run = got[kind][mesh]
            assert run["losses"] == pytest.approx(one, rel=1e-5), (kind, mesh, run, one)
            # the same updates: SGD's update is the gradient times the learning rate
            assert run["from_one_device"] <= 1e-5 * got[kind]["update"], (kind, mesh, run, got[kind])
            assert run["all_gathers"] > 0, (kind, mesh, run)  # the compiled forward pass gathers
        # layout.sequence_parallel: the blocks' outputs split along the sequence over model, so
        # the forward pass gathers tokens before the blocks' matmuls where it summed whole
        # outputs over model without it
        whole, split = got[kind]["context2_model2"], got[kind]["context2_model2_sequence"]
        assert split["all_gathers"] > whole["all_gathers"], (kind, whole, split)
        assert split["all_reduces"] < whole["all_reduces"], (kind, whole, split)
        assert got[kind]["update"] > 1e-3, got[kind]
    assert got["gathered_layers"], got  # the attention layers constrained keys and values whole
    splash = got["splash"]
    assert splash["routed"] == 2 and splash["outputs"] <= 1e-5 * splash["scale"], splash
    assert splash["gradients"] <= 1e-4, splash
