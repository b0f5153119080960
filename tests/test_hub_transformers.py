"""Transformers-format checkpoints in, keras-hub presets, transformers folders, LoRA
factors and PEFT adapters out (tests/helpers/hf_probe.py), for Llama 3, Llama 3.1, Qwen 2, Gemma and
Mistral, on both engines: the toolkit's logits are transformers' own (PEFT's on the base
checkpoint, for an adapter), and the exported config.json is the checkpoint's; and the
one-line errors of presets keras-hub cannot read."""

import json
import re
import sys

import pytest

from conftest import run_command, run_in_one_process, train

import hf_checkpoints
from hf_checks import EVERY_PROJECTION, FOUR_DEVICES, TOLERANCE, TRANSFORMERS, assert_refused
import hf_checks

CHECKPOINTS = tuple(hf_checkpoints.CHECKPOINTS)  # llama, llama31, ..., gemma, mistral
TRAINED_TF = ("llama:full", "qwen2:lora_all")
# On the mesh, the LoRA run whose PEFT adapter transformers reads; the slow tier adds Qwen's
# full fine-tune, so each family has a LoRA and a full fine-tune exported from a mesh too.
TRAINED_JAX = ("llama:lora",)
# Exported untrained on tf (the trained runs export llama and qwen2); `theta` changes the
# model's rope_theta first, on the checkpoint that keeps it inside rope_parameters.
EXPORTED_TF = ("llama31", "llama31_rope_parameters", "gemma", "mistral")
THETA = "llama31_rope_parameters"
# On the mesh, one family per kind of layout: Llama by the toolkit's rules (fsdp 2 x model 2),
# Qwen and Gemma by fsdp alone. The slow tier adds Llama 3.1 and Mistral (the same layers as
# Llama, their own rope scaling and head size). Every family's logits are the tf test's.
JAX_CHECKPOINTS = ("llama", "qwen2", "gemma")
JAX_CHECKPOINTS_SLOW = ("llama31", "mistral")


def probe(engine, out, data_dir, mesh, runs, checkpoints=CHECKPOINTS, env=None):
    return hf_checks.probe(engine, out, data_dir, mesh, runs, checkpoints, env=env)


@pytest.fixture(scope="module")
def tf_runs(tmp_path_factory, data_dir):
    """Every checkpoint on the tf engine: the first step's logits, an export of each, a full
    fine-tune of Llama and a LoRA one of Qwen on every projection with their exports
    reloaded (the jax test below adds Llama's LoRA on the query and value, on a mesh).
    transformers, PyTorch and PEFT are the `test` extra's."""
    return probe("tf", tmp_path_factory.mktemp("hf_tf"), data_dir, "1,1,1",
                 TRAINED_TF + tuple(f"{name}:export" for name in EXPORTED_TF) + (f"{THETA}:theta",
                                                                                  "llama:instruct"))


# LoRA rank 4 (alpha: PEFT's default, 8) on the query and value ('lora') or on every
# projection with rsLoRA's scaling ('lora_all'): the adapter is PEFT's of the same r, alpha,
# scaling and targets.
PEFT_CONFIG = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
               "use_rslora": False, "target_modules": ["q_proj", "v_proj"], "bias": "none",
               "lora_dropout": 0.0, "fan_in_fan_out": False, "inference_mode": True,
               "target_parameters": None}  # PEFT's own config names none where none are adapted


def assert_reloads(checks, variant):
    assert checks["moved"] > 1e-3, checks  # the run changed the logits ...
    for reload in ("keras_hub", "transformers") + (("base_plus_lora",) if variant == "lora" else ()):
        assert checks[reload] <= TOLERANCE, (variant, reload, checks)  # ... and they came back
    assert checks["torch"] <= TRANSFORMERS, checks  # transformers itself reads them
    assert checks["config"] == {}, checks  # the checkpoint's config.json, key for key
    if variant.startswith("lora"):  # PEFT's PeftModel: the adapter on the run's checkpoint
        targets = PEFT_CONFIG["target_modules"] if variant == "lora" else EVERY_PROJECTION
        assert checks["peft_base_is_the_checkpoint"], checks
        assert checks["peft_config"] == {**PEFT_CONFIG, "target_modules": targets,
                                         "use_rslora": variant == "lora_all"}, checks
        assert checks["peft"] <= TRANSFORMERS, checks
        # The trainable count is PEFT's get_peft_model's, for either choice of targets.
        for which, (toolkit, peft) in checks["trainable"].items():
            assert toolkit == peft, (which, checks["trainable"])
        # keras-hub's LoRA file: written where its loader adapts what trained, else one line.
        if variant == "lora":
            assert checks["lora_refused"] == [], checks
        else:
            assert len(checks["lora_refused"]) == 1 and "adapts the query and value projections alone" in \
                checks["lora_refused"][0] and "k_proj" in checks["lora_refused"][0], checks
        # From a keras-hub preset: the base is written beside the adapter, and is LoRA's base.
        assert checks["peft_problems"] == [] and checks["peft_written_base"] == "peft_base", checks
        assert checks["peft_on_written_base"] <= TRANSFORMERS, checks
        assert checks["written_base_alone"] <= TRANSFORMERS, checks


@pytest.mark.slow
def test_every_family_starts_from_transformers_logits_on_tf(tf_runs):
    for name in CHECKPOINTS:  # Llama 3's rms_norm_eps 1e-5, Llama 3.1's rope scaling, Mistral's head_dim
        assert tf_runs[name]["first_step"] <= TRANSFORMERS, (name, tf_runs[name])
    # generate --preset=FOLDER builds it as a run does (rms_norm_eps 1e-5 kept: 3e-3 off without)
    assert tf_runs["llama"]["generate_preset"] <= TRANSFORMERS, tf_runs["llama"]


@pytest.mark.slow
def test_evaluate_on_pairs_packed_apart_is_transformers_mean_over_each_pair_alone(tf_runs):
    """40 instruction pairs of 20 to 59 bytes, packed apart (several to a row of 65), a few
    steps of full fine-tuning: evaluate's loss is the mean over every response token that
    transformers computes on the transformers export, each pair run alone."""
    got = tf_runs["llama"]["instruct"]
    assert got["rows"] < got["pairs"], got  # several pairs share a row
    assert abs(got["evaluate"] - got["transformers"]) < 1e-4, got


@pytest.mark.slow
def test_every_export_reloads_on_tf(tf_runs):
    for name, variant in (entry.split(":") for entry in TRAINED_TF):
        checks = tf_runs[name][variant]
        assert_reloads(checks, variant)
        files = set(checks["files"])
        assert {"keras_hub/task.json", "keras_hub/model.weights.h5", "keras_hub/tokenizer.json",
                "transformers/config.json", "transformers/model.safetensors"} <= files, files
        assert ("lora.weights.h5" in files) == (variant == "lora"), files
        adapter = {"peft/adapter_config.json", "peft/adapter_model.safetensors"}
        assert (adapter <= files) == variant.startswith("lora"), files
        assert "transformers/tokenizer.json" in files or "transformers/vocab.json" in files, files


@pytest.mark.slow
def test_transformers_itself_reads_every_transformers_export_with_the_checkpoints_config(tf_runs):
    assert tf_runs["versions"].startswith("transformers "), tf_runs["versions"]
    for name in EXPORTED_TF:  # untrained: the toolkit's first-step logits, exported
        checks = tf_runs[name]["export"]
        assert checks["problems"] == [], checks
        assert checks["config"] == {}, (name, checks)  # max_position_embeddings, head_dim, rms_norm_eps ...
        assert checks["torch"] <= TRANSFORMERS, (name, checks)
        assert checks["toolkit"] <= TOLERANCE, (name, checks)
    # model.rope_max_wavelength=250000 over the checkpoint's 500000: the export says the run's.
    theta = tf_runs[THETA]["theta"]
    assert theta["moved"] > 1e-3, theta
    source = json.loads(json.dumps(hf_checkpoints.CHECKPOINTS[THETA][1]["rope_parameters"]))
    assert theta["config"] == {"rope_parameters": [source, {**source, "rope_theta": 250000.0}]}, theta
    assert theta["torch"] <= TRANSFORMERS and theta["toolkit"] <= TOLERANCE, theta




@pytest.fixture(scope="module")
def jax_mesh_runs(tmp_path_factory, data_dir):
    """Every checkpoint on a jax mesh of fsdp 2 x model 2, in one process (its folder, its
    figures): Llama's LoRA, Qwen's full fine-tune, and LoRA over Llama's int8 and int4 bases."""
    out = tmp_path_factory.mktemp("hf_jax")
    runs = TRAINED_JAX + ("qwen2:full", "llama:lora_int8", "llama:lora_int4")
    return out, probe("jax", out, data_dir, "1,2,2", runs, JAX_CHECKPOINTS + JAX_CHECKPOINTS_SLOW,
                      env=FOUR_DEVICES)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first of the module's jax tests runs jax_mesh_runs' probe
def test_on_a_jax_mesh_that_splits_weights_logits_match_and_a_lora_run_exports(jax_mesh_runs):
    out, result = jax_mesh_runs
    for name in JAX_CHECKPOINTS:  # Llama: fsdp 2 x model 2; Qwen, Gemma: fsdp 4
        assert result[name]["split_weights"] >= 8 and not result[name]["whole"], (name, result[name])
        assert result[name]["first_step"] <= TRANSFORMERS, (name, result[name])
    for name, variant in (entry.split(":") for entry in TRAINED_JAX):
        assert_reloads(result[name][variant], variant)
    # The commands that read the run, on a host that shows them the run's 4 devices (a TPU
    # VM host has 4 to 8): export and generate rebuild it on one of them, evaluate on its mesh.
    workdir = out / "llama" / "lora"
    (workdir / "export" / "peft" / "adapter_config.json").unlink()
    exported = run_command([sys.executable, "-m", "tpu_keras.export", f"--workdir={workdir}", "--formats=peft"],
                           env=FOUR_DEVICES).stdout
    assert "exported step 4 of keras_hub:Llama3CausalLM" in exported, exported[-2000:]
    assert (workdir / "export" / "peft" / "adapter_config.json").exists()
    generated = run_command([sys.executable, "-m", "tpu_keras.generate", f"--workdir={workdir}", "--prompt=def ",
                     "--max_length=12", "--temperature=0"], env=FOUR_DEVICES, merge_stderr=False).stdout
    assert generated.startswith("def "), generated
    evaluated = run_command([sys.executable, "-m", "tpu_keras.evaluate", f"--workdir={workdir}"],
                            env=FOUR_DEVICES).stdout
    assert "does not fit these" not in evaluated  # the run's own mesh: no refitting
    # On 2 devices the run's mesh of 4 is fitted to them (model 2 kept), to the same figures.
    refitted = run_command([sys.executable, "-m", "tpu_keras.evaluate", f"--workdir={workdir}"],
                           env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}).stdout
    assert "does not fit these 2 devices: using data=1 x model=2" in refitted, refitted[-2000:]
    figures = [float(re.search(r"step 4 \|.* val_loss (\S+)", out).group(1))
               for out in (evaluated, refitted)]
    assert figures[0] == pytest.approx(figures[1], abs=1e-5), figures


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_llama31_and_mistral_on_a_jax_mesh_and_a_full_fine_tune_of_qwen_from_it(jax_mesh_runs):
    _, result = jax_mesh_runs
    for name in JAX_CHECKPOINTS_SLOW + ("qwen2",):  # Llama 3.1, Mistral: fsdp 2 x model 2; Qwen: fsdp 4
        assert result[name]["split_weights"] >= 8 and not result[name]["whole"], (name, result[name])
        assert result[name]["first_step"] <= TRANSFORMERS, (name, result[name])
    assert_reloads(result["qwen2"]["full"], "full")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lora_over_an_int8_or_int4_base_trains_on_a_mesh_and_its_adapter_loads_on_the_float_base(
        jax_mesh_runs):
    result = jax_mesh_runs[1]["llama"]
    # The quantization error of the logits before training, as a share of the largest logit,
    # measured on this random tiny Llama 3: 0.048 (int8), 0.91 (int4, 16 levels per output
    # feature) and 0.39 (int4 in groups of 16 input features). These bound what Keras's
    # quantizers do here; docs/fine_tuning.md measures a trained model.
    worst = {"int8": 0.1, "int4": 1.0}
    for mode, bound in worst.items():
        checks = result[f"lora_{mode}"]
        assert checks["quantized_kernels"] == 14 == checks["split_quantized"], checks  # 2 blocks x 7
        # int4's scales and zero points, one per group, split as their kernels are.
        assert checks["scales"] == (28 if mode == "int4" else 14), checks
        assert checks["split_scales"] == (28 if mode == "int4" else 0), checks
        assert 0 < checks["before"] / checks["scale"] <= bound, checks
        assert checks["losses"][-1] < checks["losses"][0] - 0.5, checks
        # The merged export is the base dequantized plus the update: the run's own logits.
        assert checks["torch"] <= TRANSFORMERS, checks
        # PEFT's adapter applies to the float checkpoint: the run's logits but for the base's
        # quantization error.
        assert checks["peft_base_is_the_checkpoint"] and checks["peft"] / checks["scale"] <= bound, checks
    assert result["lora_int8"]["before"] < result["lora_int4"]["before"], result
    # Groups come closer to the float model than one scale per output feature.
    assert result["lora_int4"]["before"] < 0.8 * result["lora_int4"]["before_per_feature"], result




@pytest.mark.slow  # over 15 s: the full suite's (the fast tier keeps within 5 minutes)
def test_presets_keras_hub_cannot_read_are_one_line(tmp_path):
    good = tmp_path / "good"
    hf_checkpoints.write(good, "llama")
    config = json.loads((good / "config.json").read_text())
    changes = {"weightless": {}, "bloom": {"model_type": "bloom"},
               "dynamic_rope": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
               "head_dim": {"head_dim": 16}}
    for name, change in changes.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}))
        if name != "weightless":
            (tmp_path / name / "model.safetensors").symlink_to(good / "model.safetensors")
    # model.preset on the command line, on a config file that does not set it.
    layouts = run_in_one_process("tpu_keras.layout", {  # one start of keras-hub
        name: ["--config=configs/llama_stdlib.py:tiny", f"--config.model.preset={tmp_path / name}"]
        for name in changes})
    assert_refused(layouts["weightless"], "is a transformers checkpoint without weights",
                   "model.safetensors")
    assert_refused(layouts["bloom"],
                   "no converter for huggingface/transformers models with model type `'bloom'`",
                   "a family keras-hub converts")
    # Configs keras-hub's Llama3Backbone cannot build: refused, never built otherwise.
    assert_refused(layouts["dynamic_rope"], "keras-hub's converter cannot read its config.json",
                   "valid llama3 config")
    assert_refused(layouts["head_dim"], "head_dim 16 is not hidden_size / num_attention_heads",
                   "keras-hub 0.32's Llama3Backbone cannot build that model")
    # A backbone argument keras-hub builds but cannot run: one line naming the model.* key.
    assert_refused(train("configs/llama_stdlib.py:tiny", tmp_path / "w", "--config.model.num_query_heads=3",
                         check=False),
                   "does not run with", "model.num_query_heads=3", "change those model.* values")
