"""LoRA as PEFT defines it (tests/helpers/lora_probe.py): on both engines, for the gpt builder and
a keras-hub family whose query kernel puts the heads first (Gemma), the trainable weights are
the factors alone, as many as PEFT counts; the logits are those of the merged kernels the
exports write, and the base's with the adapters off (DPO's reference); the factors'
gradients are the merged model's by the chain rule; on a mesh each factor is split along its
kernel's split axis. PEFT itself reads the adapters in
tests/test_hub_transformers.py; a family of one's own: tests/test_families.py."""

import json
import re
import sys

import pytest

from conftest import run_command

MERGED = 1e-5  # the factored update against the merged kernel, float32


def probe(*args):
    out = run_command([sys.executable, "tests/helpers/lora_probe.py", *args], timeout=300).stdout
    return json.loads(re.search(r"^LORA (.*)$", out, re.M).group(1))


@pytest.mark.parametrize("engine", ["tf", pytest.param("jax", marks=pytest.mark.slow)])
def test_the_factors_alone_train_and_compute_the_merged_kernels(engine):
    result = probe(engine)
    # gpt: 2 blocks of q, k, v, o (32 -> 32) and up, down (32 <-> 128), rank 2.
    assert result["gpt"]["trainable"] == 2 * 2 * (4 * (32 + 32) + 2 * (32 + 128)) == 2304, result
    # Gemma: q and o (32 <-> 4 x 8), k and v (32 -> 2 x 8), gate, up and down (32 <-> 24), rank 2.
    assert result["gemma"]["trainable"] == 2 * (2 * (32 + 32) + 2 * (32 + 16) + 3 * (32 + 24)), result
    for model in ("gpt", "gemma"):  # Gemma: 7 projections, its query (heads, hidden, head_dim)
        checks = result[model]
        assert checks["trainable_are_factors"] and checks["trainable"] == checks["peft_count"], checks
        assert checks["adapted"] == (12 if model == "gpt" else 7), checks
        assert checks["moved"] > 0.1 and checks["merged"] < MERGED, checks
        assert checks["off_is_base"] == 0.0, checks
        # The written-out backward pass: the factors' gradients are the chain rule's from the
        # merged model's kernel gradients (relative to the largest).
        assert checks["gradients"] < 1e-4, checks


def test_on_a_mesh_each_factor_is_split_along_its_kernels_split_axis():
    specs = probe("jax", "mesh")["specs"]
    # Megatron's rules split the heads (query, key, value: axis 1 of (W, H, K); the output:
    # axis 0 of (H, K, W)) and the MLP units: B carries a column-parallel kernel's output
    # axes, A a row-parallel kernel's input axes; r and the other factor stay whole.
    expected = {f"block0_attention/{name}/lora_{f}": spec for name in ("query", "key", "value")
                for f, spec in (("a", [None, None]), ("b", [None, "model", None]))}
    expected.update({"block0_attention/attention_output/lora_a": ["model", None, None],
                     "block0_attention/attention_output/lora_b": [None, None],
                     "block0_mlp_up/lora_a": [None, None], "block0_mlp_up/lora_b": [None, "model"],
                     "block0_mlp_down/lora_a": ["model", None], "block0_mlp_down/lora_b": [None, None]})
    assert specs == expected
