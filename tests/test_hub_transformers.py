"""Transformers-format checkpoints in, keras-hub presets, transformers folders and LoRA
factors out (tests/hf_probe.py), for Llama 3 and Qwen 2, on both engines; and the one-line
errors of presets keras-hub cannot read."""

import json
import sys

import pytest

from conftest import REPO, assert_one_line_error, run, run_in_one_process, train

TOLERANCE = 1e-5
TF_RUNS = ("llama:full", "qwen2:lora")


def probe(engine, out, data_dir, mesh, runs, env=None):
    result = run([sys.executable, "tests/hf_probe.py", engine, str(out), data_dir, mesh, runs],
                 timeout=900, env=env)
    return json.loads(next(line[3:] for line in result.stdout.splitlines() if line.startswith("HF ")))


@pytest.fixture(scope="module")
def tf_runs(tmp_path_factory, data_dir):
    """A full fine-tune of Llama and a LoRA one of Qwen on the tf engine, their exports
    reloaded (the jax test below adds the other two, on a mesh)."""
    return probe("tf", tmp_path_factory.mktemp("hf_tf"), data_dir, "1,1,1", ",".join(TF_RUNS))


def test_checkpoints_load_as_keras_hub_loads_them_and_every_export_reloads_on_tf(tf_runs):
    for family, variant in (name.split(":") for name in TF_RUNS):
        assert tf_runs[family]["first_step"] <= TOLERANCE, tf_runs
        checks = tf_runs[family][variant]
        assert checks["moved"] > 1e-3, checks  # the run changed the logits ...
        for reload in ("keras_hub", "transformers") + (("base_plus_lora",) if variant == "lora" else ()):
            assert checks[reload] <= TOLERANCE, (family, variant, reload, checks)  # ... and they came back
        files = set(checks["files"])
        assert {"keras_hub/task.json", "keras_hub/model.weights.h5", "keras_hub/tokenizer.json",
                "transformers/config.json", "transformers/model.safetensors"} <= files, files
        assert ("lora.weights.h5" in files) == (variant == "lora"), files
        assert "transformers/tokenizer.json" in files or "transformers/vocab.json" in files, files


def test_transformers_itself_reads_the_transformers_export(tf_runs):
    if tf_runs["llama"]["full"]["torch"] is None:
        pytest.skip("transformers and torch are not installed here")
    for family, variant in (name.split(":") for name in TF_RUNS):
        assert tf_runs[family][variant]["torch"] <= 1e-4, tf_runs[family][variant]


def test_on_a_jax_mesh_that_splits_weights_logits_match_and_a_lora_run_exports(tmp_path, data_dir):
    # With the tf runs, a LoRA and a full fine-tune of each family.
    result = probe("jax", tmp_path, data_dir, "1,2,2", "llama:lora,qwen2:full",
                   env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    for family in ("llama", "qwen2"):  # Llama: fsdp 2 x model 2; Qwen: fsdp 4
        assert result[family]["split_weights"] >= 10, result
        assert result[family]["first_step"] <= TOLERANCE, result
    for family, variant in (("llama", "lora"), ("qwen2", "full")):
        checks = result[family][variant]
        assert checks["moved"] > 1e-3, checks
        for reload in ("keras_hub", "transformers") + (("base_plus_lora",) if variant == "lora" else ()):
            assert checks[reload] <= TOLERANCE, (family, variant, reload, checks)


def assert_refused(result, *fragments):
    """A mistake in the input: one line with `fragments`, and exit code 2."""
    assert_one_line_error(result, *fragments)
    assert result.returncode == 2, (result.stdout + (result.stderr or ""))[-2000:]


def test_presets_keras_hub_cannot_read_are_one_line(tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    import hf_checkpoints
    good = tmp_path / "good"
    hf_checkpoints.write(good, "llama")
    config = json.loads((good / "config.json").read_text())
    for name, change in (("weightless", {}), ("bloom", {"model_type": "bloom"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}))
    # model.preset on the command line, on a config file that does not set it.
    layouts = run_in_one_process("tpu_keras.layout", {  # one start of keras-hub
        name: ["--config=configs/llama_stdlib.py:tiny", f"--config.model.preset={tmp_path / name}"]
        for name in ("weightless", "bloom")})
    assert_refused(layouts["weightless"], "is a transformers checkpoint without weights",
                   "model.safetensors")
    assert_refused(layouts["bloom"],
                   "no converter for huggingface/transformers models with model type `'bloom'`",
                   "a family keras-hub converts")
    # A backbone argument keras-hub builds but cannot run: one line naming the model.* key.
    assert_refused(train("configs/llama_stdlib.py:tiny", tmp_path / "w", "--config.model.num_query_heads=3",
                         check=False),
                   "does not run with", "model.num_query_heads=3", "change those model.* values")
