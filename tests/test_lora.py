"""LoRA as PEFT defines it (tests/helpers/lora_probe.py): on both engines, for the gpt builder and
a keras-hub family whose query kernel puts the heads first (Gemma), the trainable weights are
the factors alone, as many as PEFT counts; the logits are those of the merged kernels the
exports write, and the base's with the adapters off (DPO's reference); the factors'
gradients are the merged model's by the chain rule; on a mesh each factor is split along its
kernel's split axis. Under mixed_bfloat16 a keras-hub model's frozen base is stored in bfloat16
and its factors and optimizer slots in float32, with the logits and loss of the float32 base
cast to bfloat16. PEFT itself reads the adapters in tests/test_hub_transformers.py; a family
of one's own: tests/test_families.py."""

import json
import re
import sys

import pytest

from conftest import run_command

MERGED = 1e-5  # the factored update against the merged kernel, float32


def probe(*args):
    out = run_command([sys.executable, "tests/helpers/lora_probe.py", *args], timeout=300).stdout
    return json.loads(re.search(r"^LORA (.*)$", out, re.M).group(1))


@pytest.fixture(scope="module", params=["tf", pytest.param("jax", marks=pytest.mark.slow)])
def probed(request):
    """The probe's checks on one engine, one process for the tests below."""
    return probe(request.param)


def test_the_factors_alone_train_and_compute_the_merged_kernels(probed):
    result = probed
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


def test_a_bfloat16_run_stores_its_frozen_base_in_bfloat16_and_computes_the_same_logits(probed):
    for stored, checks in probed["bfloat16_base"].items():  # the checkpoint's own dtype
        # The base (embeddings, norms, head, projections) in bfloat16: half the bytes of the
        # float32 copy; the factors and the optimizer's slots in float32, the factors alone train.
        assert checks["frozen"] == ["bfloat16"] and 2 * checks["frozen_bytes"] == checks["full_bytes"]
        assert checks["factors"] == checks["slots"] == ["float32"] and checks["factors_alone_train"]
    # From a bfloat16 checkpoint, the float32 base held the same values and was cast to
    # bfloat16 for compute: the same logits and loss at step 0, to the bit. The head computes
    # float32 logits from the bfloat16 table as from the float32 one (lora.float32_head).
    exact = probed["bfloat16_base"]["bfloat16"]
    assert exact["logits"] == 0.0 and exact["loss"][0] == exact["loss"][1], exact
    # The exports' copy reads the base in float32 and merges the update there.
    assert exact["export"] == {"dtypes": ["float32"], "merged": 0.0}, exact
    # From a float32 checkpoint, the rounded head alone differs (Keras's embeddings do not
    # autocast: under mixed_bfloat16 the head read the float32 table): 7.6e-3 of the largest
    # logit 3.8 (2.0e-3) and 2e-4 of the loss, measured on both engines; nothing with the head
    # rounded alike.
    rounded = probed["bfloat16_base"]["float32"]
    assert 0 < rounded["logits"] <= 4e-3 * rounded["scale"] and rounded["logits_head_rounded"] == 0.0
    assert abs(rounded["loss"][0] - rounded["loss"][1]) <= 1e-3, rounded


@pytest.mark.slow  # over 15 s: the full suite's (the fast tier keeps within 5 minutes)
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


def test_all_linear_adapts_the_projections_a_model_has_and_a_named_one_it_lacks_is_one_line():
    """PEFT's 'all-linear' is every linear layer the model has: a family's target that a size
    lacks (Gemma 4's per-layer embeddings, absent from its larger sizes) is no error; named
    in model.lora_targets, it is."""
    import keras
    from tpu_keras.errors import UserError
    from tpu_keras.models import lora
    targets = (lora.Target("q_proj", "q"), lora.Target("extra_proj", "extra"))

    def model():
        inputs = keras.Input((4,))
        return keras.Model(inputs, keras.layers.Dense(3, name="q")(inputs), name="small")

    every = lora.settings({"lora_rank": 2, "lora_targets": "all-linear"}, targets, ("q_proj",), "small")
    assert [layer.name for layer in lora.attach(model(), targets, every)] == ["q"]
    named = lora.settings({"lora_rank": 2, "lora_targets": "q_proj,extra_proj"}, targets, ("q_proj",), "small")
    with pytest.raises(UserError, match=r"model.lora_targets \['extra_proj'\] match no layer of small"):
        lora.attach(model(), targets, named)
