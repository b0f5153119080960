"""A base quantized as it is read (tests/helpers/quantize_probe.py): the same logits as one
quantized once loaded, int4 in groups, and the bad input of a quantized base; and what
quantizing costs a trained model (scripts/quantization_quality.py)."""

import json
import math
import re
import sys

import pytest

from conftest import run_command, train

pytestmark = pytest.mark.slow  # keras-hub: a 2 x 2 mesh and nine models; a run and four more


def test_quantized_while_read_equals_quantized_once_loaded_and_bad_input_is_one_line(tmp_path):
    out = run_command([sys.executable, "tests/helpers/quantize_probe.py", str(tmp_path)],
                      timeout=600).stdout
    result = json.loads(out.strip().splitlines()[-1])
    cases = result["cases"]
    for name, case in cases.items():
        # Bit-identical: Keras's own quantizers, on the same float values, whichever path.
        assert case["identical"], (name, case)
        assert case["quantized_kernels"] == 28, (name, case)  # 4 blocks x 7 projections
    assert len(cases) == 5, cases
    # The error of the logits, as a share of the largest float logit (random weights: a
    # trained model's are in docs/fine_tuning.md): int8 < int4 in groups < int4 per feature.
    # Measured: 0.032, 0.39 (groups of 64), 0.40 (128), 0.52.
    assert cases["int8/0"]["error"] < 0.1, cases
    for block in ("64", "128"):
        assert cases[f"int4/{block}"]["error"] < 0.9 * cases["int4/-1"]["error"], cases
    assert result["block_error"] == ("model.quantize_block_size=96 does not divide the 512 input "
                                     "features of transformer_layer_0/feedforward_output_dense; "
                                     "set model.quantize_block_size=256")
    assert "holds no tensor model.layers.1.mlp.up_proj.weight" in result["lacking_error"], result
    assert "holds 1 tensor(s) this model does not have, such as model.layers.0.self_attn.q_norm" \
        in result["extra_error"], result
    assert "a weight file cannot be read" in result["truncated_error"], result
    assert "cut short" in result["truncated_error"], result
    for key in ("block_error", "lacking_error", "extra_error", "truncated_error"):
        assert "\n" not in result[key], result[key]


def test_quantization_quality_measures_the_runs_own_loss_and_each_quantized_base(tmp_path, data_dir):
    workdir = tmp_path / "llama_tiny"
    trained = train("configs/llama_stdlib.py:tiny", workdir, f"--config.data.data_dir={data_dir}").stdout
    run_loss = float(re.findall(r"\| val_loss ([\d.]+)", trained)[-1])  # at step 20, 4 digits
    out = run_command([sys.executable, "scripts/quantization_quality.py", f"--workdir={workdir}",
                       "--block_sizes=-1,16"], timeout=300).stdout
    report = json.loads(next(line for line in out.splitlines() if line.startswith('{"base"')))
    assert "| int4, groups of 16 |" in out, out[-2000:]
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == ["float", "int8", "int4, one scale per output feature", "int4, groups of 16"]
    assert (report["batches"], report["tokens"]) == (2, 2 * 16 * 64)  # tiny: eval_steps, batch, context
    assert all(math.isfinite(row[key]) for row in rows.values()
               for key in ("val_loss", "val_bits_per_byte")), rows
    floating = rows["float"]["val_loss"]
    # The base from the run's export, under a LoRA update of zero: the run's own validation.
    assert abs(floating - run_loss) < 1e-3, (floating, run_loss)
    assert abs(rows["int8"]["val_loss"] - floating) < 0.01 * floating, rows
    for name in ("int4, one scale per output feature", "int4, groups of 16"):
        assert rows[name]["val_loss"] != floating, (name, rows)  # quantized, not the float base
        assert abs(rows[name]["loss_increase"]) < 0.05 * floating, (name, rows)
    # The kernels' error: int8's small; int4's min-max groups of 16 finer than a scale per feature.
    errors = {name: row["kernel_error"] for name, row in rows.items()}
    assert errors["float"] == 0 and 0 < errors["int8"] < 0.02, errors
    assert errors["int4, groups of 16"] < 0.8 * errors["int4, one scale per output feature"], errors
