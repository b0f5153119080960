"""The newer families (tests/test_newer_families.py) on a jax mesh, fsdp 2 x model 2: their
logits are transformers' own, and a LoRA on every projection is PEFT's. A module apart from
the one-device checks, so that xdist's two workers each take one of the two long halves."""

import pytest

from hf_checks import EVERY_PROJECTION, FOUR_DEVICES, TOLERANCE, TRANSFORMERS, probe
from test_newer_families import GROUPS, OWN_LINEAR, OWN_RULE, relative


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("group", GROUPS, ids=lambda group: "-".join(group))
def test_newer_families_on_a_jax_mesh_lora_on_every_projection_reads_in_peft(group, tmp_path, data_dir):
    result = probe("jax", tmp_path, data_dir, "1,2,2", tuple(f"{name}:lora_all" for name in group), group,
                   env=FOUR_DEVICES)
    for name in group:  # fsdp 2 x model 2, by the family's own rules
        assert result[name]["split_weights"] >= 8 and not result[name]["whole"], (name, result[name])
        assert relative(result, name, result[name]["first_step"]) <= TRANSFORMERS, (name, result[name])
        checks = result[name]["lora_all"]
        assert checks["losses"][-1] < checks["losses"][0], (name, checks["losses"])
        assert checks["moved"] > 1e-3, (name, checks)
        if name in OWN_RULE:  # keras-hub's own rule against the run's: float32's rounding apart
            assert relative(result, name, checks["keras_hub"]) <= OWN_RULE[name], (name, checks)
        else:
            assert checks["keras_hub"] <= TOLERANCE, (name, checks)
        assert checks["config"] == {} and checks["peft_base_is_the_checkpoint"], (name, checks)
        for gap in ("torch", "peft", "peft_on_written_base"):  # transformers, PEFT on the checkpoint
            assert relative(result, name, checks[gap]) <= TRANSFORMERS, (name, gap, checks)
        # PEFT's all-linear: Gemma 4's per-layer embedding projections too
        every = sorted(EVERY_PROJECTION + OWN_LINEAR.get(name, []))
        assert checks["peft_config"]["target_modules"] == every, (name, checks)
        for which, (toolkit, peft) in checks["trainable"].items():  # q_proj,v_proj and all-linear
            assert toolkit == peft, (name, which, checks["trainable"])
