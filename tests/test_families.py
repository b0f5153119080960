"""Adding a model family is one file: tests/helpers/otter_family.py registers Otter (keras-hub's
Llama 3 under another name, LoRA on the four attention projections by default), and a config
that names it through `model.imports` trains it with LoRA, exports it to transformers and
PEFT (read by their own clients), and plans it, with no file of the toolkit's touched."""

import json
import re
import sys

import pytest

from conftest import run_command

FAMILY = "tests/helpers/otter_family.py"
TRANSFORMERS = 1e-4  # the toolkit against transformers' own PyTorch model, float32


@pytest.mark.slow
def test_a_family_from_one_file_trains_with_lora_and_exports_to_transformers_and_peft(tmp_path, data_dir):
    out = run_command([sys.executable, "tests/helpers/family_probe.py", str(tmp_path), data_dir], timeout=300).stdout
    got = json.loads(re.search(r"^FAMILY (.*)$", out, re.M).group(1))
    assert got["backbone"] == "OtterBackbone", got
    # The family's own default targets, at rank 4: q, k, v, o of one block, 4 x (32 + 32) each.
    assert got["adapter"] == {"r": 4, "lora_alpha": 8,
                              "target_modules": ["k_proj", "o_proj", "q_proj", "v_proj"]}, got
    assert got["trainable"] == 4 * 4 * (32 + 32), got
    assert {"keras_hub", "transformers", "peft", "peft_base"} <= set(got["formats"]), got
    assert got["transformers"] <= TRANSFORMERS and got["peft"] <= TRANSFORMERS, got
    assert got["imports_kept"][0].endswith(FAMILY), got  # config.json: absolute, for any folder


def test_a_family_from_one_file_plans_with_its_layout_rules():
    plan = run_command([sys.executable, "-m", "tpu_keras.plan", "--config=configs/llama_stdlib.py:lora",
                "--config.model.name=keras_hub:OtterCausalLM", f"--config.model.imports={FAMILY}",
                "--config.engine=jax", "--config.mesh.model=2", "--tpu=v5litepod-8", "--json"]).stdout
    got = json.loads(plan[plan.index("{"):])
    assert got["model"] == "keras_hub:OtterCausalLM" and got["mesh"]["model"] == 2, got
    # Gradients of the LoRA factors alone, split as Llama's rules split their kernels: per
    # projection A (32, 4) whole and B (4, 2 heads, 16) half on each device (q, k, v), or A
    # (2 heads, 16, 4) half and B (4, 32) whole (o): 192 float32 values each.
    assert got["per_device"]["gradients"] == 4 * 192 * 4, got["per_device"]
