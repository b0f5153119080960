"""The MoE families (tests/test_moe.py) on jax meshes with an expert axis: their logits are
transformers' own, the experts split, and on expert 2 x fsdp 2 a LoRA whose adapter PEFT
reads. A module apart from the one-device checks, so that xdist's two workers each take one
of the two long halves."""

import pytest

from hf_checks import FOUR_DEVICES, TRANSFORMERS, probe
from test_moe import EXPERTS, FAMILIES, ROUTER, relative


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mesh", ["1,2,1,2", "1,1,2,2"], ids=["fsdp2-expert2", "model2-expert2"])
def test_moe_families_on_expert_meshes_train_a_lora_peft_reads(mesh, tmp_path, data_dir):
    """data, fsdp, model, expert: the experts split over `expert`; with fsdp, a LoRA run whose
    adapter PEFT reads on the checkpoint to the run's logits."""
    runs = tuple(f"{name}:lora" for name in FAMILIES) if mesh == "1,2,1,2" else ()
    result = probe("jax", tmp_path, data_dir, mesh, runs, FAMILIES, env=FOUR_DEVICES, lean=True)
    for name in FAMILIES:
        assert relative(result, name, result[name]["first_step"]) <= TRANSFORMERS, (name, result[name])
        # Only the routers stay whole (experts.rules: small, and each device routes its tokens).
        whole = [path for path in result[name]["whole"] if not ROUTER.search(path)]
        assert not whole, (name, whole)
        assert any(EXPERTS.search(path) for path in result[name]["split_paths"]), (name, result[name])
        if runs:
            checks = result[name]["lora"]
            assert checks["losses"][-1] < checks["losses"][0], (name, checks["losses"])
            assert checks["config"] == {} and checks["peft_base_is_the_checkpoint"], (name, checks)
            for gap in ("torch", "peft"):  # the merged export in transformers, the adapter in PEFT
                assert relative(result, name, checks[gap]) <= TRANSFORMERS, (name, gap, checks)
            # The merged export read by plain keras-hub (its dense expert bank). gpt-oss's is the run's
            # weights in keras-hub's own model, whose sliding windows sit on other blocks
            # (docs/fine_tuning.md): it attends as keras-hub does, 0.51 of the logit scale apart here.
            if name == "gpt_oss":
                assert relative(result, name, checks["keras_hub"]) > 1e-2, (name, checks)
            else:
                assert relative(result, name, checks["keras_hub"]) <= TRANSFORMERS, (name, checks)
            assert checks["peft_config"]["target_modules"] == ["q_proj", "v_proj"], (name, checks)
            # These runs adapt their experts too, as PEFT's target_parameters (hf_probe.EXPERT_PARAMETERS)
            experts = (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
                       if name in ("gpt_oss", "qwen3_moe", "qwen3_5_moe_text") else None)
            assert checks["peft_config"]["target_parameters"] == experts, (name, checks["peft_config"])
            toolkit, peft = checks["trainable"]["lora"]  # the same factors as PEFT's, experts included
            assert toolkit == peft, (name, checks["trainable"])
