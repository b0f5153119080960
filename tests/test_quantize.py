"""A base quantized as it is read (tests/helpers/quantize_probe.py): the same logits as one
quantized once loaded, int4 in groups, and the bad input of a quantized base; read by two
hosts, each its share (tests/helpers/host_share_probe.py); and what quantizing costs a
trained model (scripts/quantization_quality.py)."""

import json
import math
import re
import sys

import pytest

from conftest import run_command, train

pytestmark = pytest.mark.slow  # keras-hub: a 2 x 2 mesh and nine models; two hosts; a run and four more


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


def test_two_hosts_each_read_their_share_of_the_projections_and_build_the_same_base(tmp_path):
    """A simulated 2-host launch quantizes while reading with each projection read by one host
    (counted by the loader's log line): each host reads at most half of the projections' bytes
    plus one tensor, and every weight, and the logits, equal one process's."""
    checkpoint = tmp_path / "transformers"
    run_command([sys.executable, "scripts/llama_checkpoint.py", "--size=tiny", "--shard_mib=4",
                 str(checkpoint)])
    cases = ["int8/0", "int4/-1", "int4/64"]
    probe = [sys.executable, "tests/helpers/host_share_probe.py", str(checkpoint), *cases]
    one = probed(run_command(probe, timeout=300).stdout)
    launched = run_command([sys.executable, "-m", "tpu_keras.launch", "--hosts=2", "--devices_per_host=2",
                            "--timeout=300", "--", *probe], timeout=400).stdout
    two = probed(launched)
    assert sorted(one) == sorted((case, 0) for case in cases), sorted(one)
    assert sorted(two) == sorted((case, host) for case in cases for host in (0, 1)), sorted(two)
    for (case, host), got in two.items():
        expected = one[case, 0]
        differ = [path for path, digest in expected["digests"].items() if got["digests"][path] != digest]
        assert not differ and got["digests"].keys() == expected["digests"].keys(), (case, host, differ)
        assert got["logits"] == expected["logits"], (case, host)
    sizes = projection_bytes(checkpoint)
    reads = re.findall(r"\[host (\d)\] .*base: host \d of 2 read and quantized (\d+) of (\d+) "
                       r"projections \(([\d,]+) bytes\)", launched)
    assert len(reads) == 2 * len(cases), launched[-3000:]
    for case in range(len(cases)):
        both = reads[2 * case:2 * case + 2]
        assert {host for host, *_ in both} == {"0", "1"}, both
        assert sum(int(count) for _, count, _, _ in both) == len(sizes) == int(both[0][2]), both
        assert sum(int(read.replace(",", "")) for *_, read in both) == sum(sizes), both
        for *_, read in both:
            assert int(read.replace(",", "")) <= sum(sizes) / 2 + max(sizes), (both, sum(sizes), max(sizes))


def probed(output: str) -> dict:
    """{(case, host): the probe's report} from tests/helpers/host_share_probe.py's output."""
    reports = [json.loads(line.split("PROBE ", 1)[1]) for line in output.splitlines() if "PROBE {" in line]
    return {(report["case"], report["host"]): report for report in reports}


def projection_bytes(checkpoint) -> list:
    """The bytes of each attention and MLP projection in a Llama transformers checkpoint, from
    its safetensors headers."""
    from safetensors import safe_open
    sizes = []
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(shard), "np") as file:
            for name in file.keys():
                if re.search(r"\.(q|k|v|o|gate|up|down)_proj\.weight$", name):
                    tensor = file.get_slice(name)
                    sizes.append(math.prod(tensor.get_shape()) * 2)  # bfloat16
                    assert tensor.get_dtype() == "BF16", name
    return sizes


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
