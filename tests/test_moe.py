"""Mixtures of experts: the sparse layer (tpu_keras/models/moe.py) against keras-hub's dense bank,
transformers' load-balancing loss and the TPU compiler's cost analysis (tests/helpers/moe_probe.py);
the MoE families from checkpoints transformers 5's save_pretrained writes (8 experts, top 2:
tests/helpers/hf_pretrained.py), on one device and on expert meshes, against transformers and
PEFT (tests/helpers/hf_probe.py); and their bad inputs, one line each."""

import json
import sys

import pytest

from conftest import run_command, run_in_one_process
from hf_checks import FOUR_DEVICES, TOLERANCE, TRANSFORMERS, assert_refused, probe
import hf_pretrained

FAMILIES = ("qwen3_moe", "mixtral")  # the MoE checkpoints keras-hub 0.32 reads as transformers writes them


def relative(result, name, gap: float) -> float:
    return gap / result[name]["scale"]


@pytest.mark.slow
def test_sparse_layer_is_keras_hubs_bank_at_top_k_over_e_of_its_flops():
    result = run_command([sys.executable, "tests/helpers/moe_probe.py"], timeout=600)
    found = json.loads(next(line[4:] for line in result.stdout.splitlines() if line.startswith("MOE ")))
    assert found["tiled"] < 1e-4, found["tiled"]  # the CPU's tiles are ragged_dot's products
    for name, checks in found["blocks"].items():  # Qwen3-MoE, Mixtral, Qwen 3.5's, gpt-oss
        assert checks["output"] <= 1e-5 * checks["scale"] and checks["gradients"] < 1e-4, (name, checks)
    for case, (ours, theirs) in found["aux"].items():  # transformers' load_balancing_loss_func
        assert abs(ours - theirs) <= 1e-5, (case, ours, theirs)
    capacity = found["capacity"]
    assert capacity["dropped"] == capacity["by_hand"] > 0 and capacity["dropless_dropped"] == 0, capacity
    assert capacity["per_expert"] == capacity["by_hand_per_expert"], capacity
    flops = found["flops"]  # compiled for a TPU v5e chip: within 1.25x of top_k / E of the dense bank's
    assert flops["ratio"] <= 1.25 * flops["top_k_over_experts"], flops


@pytest.mark.skip(reason="issue 66: the export's host copy numbers keras-hub's unnamed MoE blocks "
                         "('qwen3_sparse_moe_block_2'), so its weight paths differ from the run's")
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_families_start_from_transformers_logits_and_export_round_trips(tmp_path, data_dir):
    runs = tuple(f"{name}:{run}" for name in FAMILIES for run in ("export", "aux"))
    result = probe("jax", tmp_path, data_dir, "1,1,1", runs, FAMILIES)
    for name in FAMILIES:
        assert relative(result, name, result[name]["first_step"]) <= TRANSFORMERS, (name, result[name])
        aux = result[name]["aux"]  # the run's loss term over its coefficient, transformers' own
        assert abs(aux["toolkit"] - aux["transformers"]) <= 1e-5, (name, aux)
        checks = result[name]["export"]
        assert checks["problems"] == [] and checks["config"] == {}, (name, checks)
        assert relative(result, name, checks["torch"]) <= TRANSFORMERS, (name, checks)
        assert checks["toolkit"] <= TOLERANCE, (name, checks)


@pytest.mark.skip(reason="not yet run to the end on this machine (issue 66): enabled with its first green run")
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mesh", ["1,2,1,2", "1,1,2,2"], ids=["fsdp2-expert2", "model2-expert2"])
def test_moe_families_on_expert_meshes_train_a_lora_peft_reads(mesh, tmp_path, data_dir):
    """data, fsdp, model, expert: the experts split over `expert`; with fsdp, a LoRA run whose
    adapter PEFT reads on the checkpoint to the run's logits."""
    runs = tuple(f"{name}:lora" for name in FAMILIES) if mesh == "1,2,1,2" else ()
    result = probe("jax", tmp_path, data_dir, mesh, runs, FAMILIES, env=FOUR_DEVICES)
    for name in FAMILIES:
        assert relative(result, name, result[name]["first_step"]) <= TRANSFORMERS, (name, result[name])
        assert not result[name]["whole"], (name, result[name]["whole"])
        assert any("experts/" in path for path in result[name]["split_paths"]), (name, result[name])
        if runs:
            checks = result[name]["lora"]
            assert checks["losses"][-1] < checks["losses"][0], (name, checks["losses"])
            assert checks["config"] == {} and checks["peft_base_is_the_checkpoint"], (name, checks)
            for gap in ("torch", "peft"):  # the merged export in transformers, the adapter in PEFT
                assert relative(result, name, checks[gap]) <= TRANSFORMERS, (name, gap, checks)
            assert checks["peft_config"]["target_modules"] == ["q_proj", "v_proj"], (name, checks)


@pytest.mark.slow
def test_moe_bad_inputs_are_one_line(tmp_path):
    moe_folder, dense_folder = tmp_path / "qwen3_moe", tmp_path / "qwen3"
    hf_pretrained.write(moe_folder, "qwen3_moe")
    hf_pretrained.write(dense_folder, "qwen3")
    base = {"moe": ["--config=tests/helpers/checkpoint_config.py:Qwen3MoeCausalLM",
                    f"--config.model.preset={moe_folder}", "--config.engine=jax"],
            "dense": ["--config=tests/helpers/checkpoint_config.py:Qwen3CausalLM",
                      f"--config.model.preset={dense_folder}", "--config.engine=jax"]}
    cases = {
        "indivisible": base["moe"] + ["--config.mesh.expert=3", "--devices=3"],
        "dense": base["dense"] + ["--config.mesh.expert=2", "--devices=2"],
        "capacity": base["moe"] + ["--config.model.moe_capacity_factor=0"],
        "capacity_dense": base["dense"] + ["--config.model.moe_capacity_factor=1.25"],
    }
    layouts = run_in_one_process("tpu_keras.layout", cases)
    assert_refused(layouts["indivisible"], "expert", "3")
    assert_refused(layouts["dense"], "mesh.expert=2", "has none", "mesh.data or mesh.fsdp")
    assert_refused(layouts["capacity"], "model.moe_capacity_factor=0 keeps no token", "leave it out")
    assert_refused(layouts["capacity_dense"], "model.moe_capacity_factor=1.25", "has none; drop it")
    # On the tf engine: mesh.resolve's "mesh.expert=2 needs the jax engine" (test_mesh_and_rules.py).
