"""keras-hub models through the toolkit: both engines, a hybrid mesh, checked layout maps,
presets, LoRA, and text generation."""

import json
import re
import sys
import textwrap

import numpy as np
import pytest

from conftest import REPO, assert_one_line_error, run_command, run_in_one_process, train
import hf_pretrained
from placements import assert_laid_out_as_placed, assert_same_losses

LLAMA_TINY = "configs/llama_stdlib.py:tiny"


def generate(workdir, *flags):
    return run_command([sys.executable, "-m", "tpu_keras.generate", f"--workdir={workdir}", *flags],
                       merge_stderr=False)


@pytest.mark.slow
def test_sentencepiece_llama_trains_on_packed_text_exports_and_generates(stdlib_text, data_dir, tmp_path):
    """configs/llama_stdlib.py:spm_tiny: LlamaTokenizer on the offline vocabulary, the tf
    engine (the jax engine trains keras-hub's Llama in tests/helpers/hf_probe.py, the
    DPO test and the hybrid mesh below). One start of keras-hub per command."""
    workdir = tmp_path / "tf"
    out = train("configs/llama_stdlib.py:spm_tiny", workdir, f"--config.data.data_dir={data_dir}").stdout
    assert "model: keras_hub:LlamaCausalLM with 75,872 parameters, float32" in out, out[-2000:]
    assert re.search(r"validation/\*\.txt \(LlamaTokenizer\(spm1024\.model\), 65 tokens per "
                     r"sequence\): 55 documents, [\d,]+ tokens, 0\.\d+ tokens per byte", out), out[-3000:]
    lines = re.findall(r"step \d+/20 \| bits_per_byte (\S+) \| bits_per_token (\S+) \| .*? loss "
                       r"(\S+) \| val_bits_per_byte (\S+) \| val_bits_per_token (\S+)", out)
    assert len(lines) == 2, out[-3000:]
    for bpb, bpt, loss, val_bpb, val_bpt in (map(float, line) for line in lines):
        assert bpt == pytest.approx(float(loss) / np.log(2), rel=1e-3)
        assert 0.2 < val_bpb / val_bpt < 0.6  # x tokens per byte: 1,024 pieces are 2-5 bytes
    assert float(lines[1][2]) < float(lines[0][2])
    assert re.search(r"done at step 20: val_bits_per_byte \d", out)
    assert (workdir / "export" / "saved_model.pb").exists()
    assert (workdir / "export" / "keras_hub" / "task.json").exists()  # and no transformers/:
    assert not (workdir / "export" / "transformers").exists()  # LlamaBackbone has no exporter
    # Asked for, it is one line, after the other formats are written.
    (workdir / "export" / "keras_hub" / "task.json").unlink()
    exported = run_in_one_process("tpu_keras.export", {
        "transformers": [f"--workdir={workdir}", "--step=10", "--formats=keras_hub,transformers"],
        "unsaved_step": [f"--workdir={workdir}", "--step=7"],
        "peft": [f"--workdir={workdir}", "--step=10", "--formats=peft"]})
    assert_one_line_error(exported["transformers"], "no transformers exporter for LlamaBackbone",
                          "the other formats were written")
    assert exported["transformers"].returncode == 2
    assert "exported step 10 of" in exported["transformers"].stdout
    assert (workdir / "export" / "keras_hub" / "task.json").exists()
    assert_one_line_error(exported["unsaved_step"], "--step=7 is not a checkpoint", "[10, 20]")
    assert_one_line_error(exported["peft"], "export format 'peft' needs a LoRA run (model.lora_rank)",
                          "trained every weight; drop 'peft' from export.formats")
    # Generation reads and writes the run's own SentencePiece pieces.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "import ", "id": 7}\n\n"def "\n')
    generated = run_in_one_process("tpu_keras.generate", {
        "prompt": [f"--workdir={workdir}", "--prompt=def ", "--max_length=40", "--seed=3", "--top_k=20"],
        "file": [f"--workdir={workdir}", f"--prompts_file={prompts}", "--seed=1"]})
    text = generated["prompt"].stdout
    assert text.startswith("def ") and len(text) > len("def "), text
    lines = [json.loads(line) for line in generated["file"].stdout.splitlines()]
    assert [(line["prompt"], line.get("id")) for line in lines] == [("import ", 7), ("def ", None)]
    assert all(line["text"].startswith(line["prompt"]) and len(line["text"]) > len(line["prompt"])
               for line in lines), lines


@pytest.mark.slow
def test_llama_on_a_hybrid_mesh_shards_by_its_rules_and_matches_one_device(data_dir, tmp_path):
    # One process: one device first, which saves the initial weights the mesh's run loads.
    out = run_command([sys.executable, "tests/helpers/mesh_probe.py", "1x1,4x2", data_dir,
                       str(tmp_path / "init.npz"), "llama_stdlib:tiny"], timeout=500).stdout
    reference, result = (json.loads(line[len("PROBE "):]) for line in out.splitlines()
                         if line.startswith("PROBE "))
    assert reference["mesh"]["data"] == reference["mesh"]["model"] == 1, reference["mesh"]
    assert result["mesh"] == {"slices": 1, "data": 4, "fsdp": 1, "expert": 1, "context": 1, "model": 2}
    # Both embeddings, the query/key/value/output kernels and the three MLP kernels.
    assert assert_laid_out_as_placed(result) == 9
    assert_same_losses(result, reference)


LLAMA_MESH = [f"--config={LLAMA_TINY}", "--config.mesh.data=2", "--config.mesh.model=2",
              "--config.layout.replicate_below=4096"]
REVERSE_RULE = "((r'token_embedding/reverse_embeddings', (None, 'model')),)"

FAMILIES = '''
from tpu_keras.config import defaults

FAMILIES = {
    "gemma": dict(name="keras_hub:GemmaCausalLM", vocabulary_size=256, num_layers=1,
                  num_query_heads=4, num_key_value_heads=1, hidden_dim=64, intermediate_dim=128,
                  head_dim=16),
    "qwen3_moe": dict(name="keras_hub:Qwen3MoeCausalLM", vocabulary_size=256, num_layers=1,
                      num_query_heads=4, num_key_value_heads=2, hidden_dim=64, intermediate_dim=128,
                      moe_intermediate_dim=64, num_experts=4, top_k=2, head_dim=16),
}


def get_config(family):
    config = defaults()
    config.engine = "jax"
    config.model = dict(FAMILIES[family], context_length=64)
    config.mesh = dict(data=1, expert=1, model=2)
    config.layout.replicate_below = 4096
    return config
'''


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The layout reports below, in one process (one start of keras-hub and JAX)."""
    families = tmp_path_factory.mktemp("families") / "families.py"
    families.write_text(FAMILIES)
    return run_in_one_process("tpu_keras.layout", {
        "keras_hub_map": LLAMA_MESH + ["--config.model.layout_map=keras_hub"],
        "keras_hub_map_and_head": LLAMA_MESH + ["--config.model.layout_map=keras_hub",
                                                f"--config.layout.extra_rules={REVERSE_RULE}"],
        "toolkit_rules": LLAMA_MESH,
        "gemma": [f"--config={families}:gemma"],
        "qwen3_moe": [f"--config={families}:qwen3_moe", "--config.model.layout_map=keras_hub",
                      f"--config.layout.extra_rules={REVERSE_RULE}"],
        "qwen3_moe_toolkit": [f"--config={families}:qwen3_moe", "--config.mesh.expert=2"],
    })


def test_keras_hub_llama_map_is_refused_and_the_toolkit_rules_pass(layouts):
    # keras-hub's own map leaves the untied output head out: one line, with the fix.
    assert_one_line_error(layouts["keras_hub_map"],
                          "weight 'token_embedding/reverse_embeddings' [32, 256]",
                          "covered by no layout rule", f"layout.extra_rules={REVERSE_RULE}")
    # With that added, the next gap: heads over 'data' in Q/K/V, over 'model' in the output.
    assert_one_line_error(layouts["keras_hub_map_and_head"],
                          "the attention heads are split two ways",
                          "'transformer_layer_0/self_attention/query/kernel' dimension 1 over 'data'",
                          "attention_output/kernel' dimension 0 over 'model'")
    assert layouts["toolkit_rules"].returncode == 0, layouts["toolkit_rules"].stderr[-2000:]
    table = layouts["toolkit_rules"].stdout  # the toolkit's rules for the Llama family
    assert re.search(r"^token_embedding/reverse_embeddings\s+32x256\s+P\(None, 'model'\)", table, re.M), table
    assert re.search(r"^transformer_layer_0/self_attention/attention_output/kernel\s+2x16x32\s+"
                     r"P\('model', None, None\)", table, re.M), table


def test_keras_hub_maps_of_other_families_are_checked(layouts):
    # Gemma splits key/value kernels by their KV heads: 1 in gemma_2b_en.
    assert_one_line_error(layouts["gemma"], "'decoder_block_0/attention/key/kernel' [1, 64, 16]: "
                          "dimension 0 (1) does not divide by mesh axis 'model' (2)")
    # Qwen3 MoE: the experts' weights have no /kernel suffix, so no rule of its map matches them.
    assert_one_line_error(layouts["qwen3_moe"],
                          "'transformer_layer_0/qwen3_sparse_moe_block/experts/"
                          "expert_feedforward_gate_dense' [4, 64, 128]", "covered by no layout rule")
    # The toolkit's rules (models/families/qwen3_moe.py): the experts over `expert`.
    toolkit = layouts["qwen3_moe_toolkit"]
    assert toolkit.returncode == 0, toolkit.stderr[-2000:]
    assert re.search(r"^transformer_layer_0/qwen3_sparse_moe_block(_1)?/experts/expert_feedforward_output_dense"
                     r"\s+4x64x64\s+P\('expert', 'model', None\)", toolkit.stdout, re.M), toolkit.stdout


@pytest.mark.slow
def test_a_saved_preset_is_loaded_not_reinitialised_on_both_engines(tmp_path):
    for engine in ("tf", "jax"):
        out = run_command([sys.executable, "tests/helpers/hub_preset.py", engine, str(tmp_path / engine)]).stdout
        losses = json.loads(next(l for l in out.splitlines() if l.startswith("PRESET "))[7:])
        assert abs(losses["loaded"] - losses["saved"]) <= 1e-6, (engine, losses)
        assert abs(losses["scratch"] - losses["saved"]) > 1e-4, (engine, losses)


@pytest.mark.slow
def test_a_preset_loads_under_fsdp_8_with_no_whole_weight_on_one_device_and_nothing_compiled(tmp_path):
    """keras-team/keras#21634, measured on 8 fake devices (tests/helpers/load_memory_probe.py)."""
    out = run_command([sys.executable, "tests/helpers/load_memory_probe.py", str(tmp_path / "preset")],
                      timeout=500).stdout
    load = json.loads(next(line for line in out.splitlines()
                           if line.startswith("LOAD "))[len("LOAD "):])
    toolkit, alone = load["toolkit"], load["keras_hub"]
    assert toolkit["difference"] == alone["difference"] == 0, load  # the preset's weights
    assert toolkit["end"] == alone["end"] and len(set(toolkit["end"])) == 1, load  # split 8 ways
    for peak, end in zip(toolkit["peak"], toolkit["end"]):
        assert peak <= end + toolkit["largest_replicated"], load
    # keras-hub alone passes each whole weight through device 0 (the check can fail).
    assert alone["peak"][0] > alone["end"][0] + 2 * alone["largest_replicated"], load
    # No initial values compiled only to be overwritten (Keras compiles one per weight here) ...
    assert toolkit["compiles"] == 0, load
    # ... and a weight the loader leaves alone still gets its initializer's values.
    assert load["unloaded"]["kernel"] == 0 and set(load["unloaded"]["bias"]) == {1.0}, load


@pytest.mark.slow
def test_splash_attention_gives_keras_hubs_llama_outputs_and_gradients_at_every_real_token():
    """The TPU's fused kernel, in Pallas's interpreter, under data x fsdp x model (splash_probe.py),
    on rows with padding and on rows of examples packed apart: Llama, Qwen 3, Gemma 3's and
    Gemma 4's sliding and global layers, and Qwen 3.5's full attention layers."""
    out = run_command([sys.executable, "tests/helpers/splash_probe.py"], timeout=700).stdout
    got = json.loads(next(line for line in out.splitlines()
                          if line.startswith("SPLASH "))[len("SPLASH "):])
    # Every decoder layer: Gemma 3's five sliding layers and its global one, Gemma 4's sliding and global.
    served = {"llama": 2, "qwen3": 2, "gemma3": 6, "gemma4": 2, "qwen3_5": 1}  # Qwen 3.5: its full attention
    assert {name: got[name]["routed"] for name in served} == served, got
    for name in served:
        model = got[name]
        # Gemma 4 scales no attention logit (its query and key norms stand for 1 / sqrt(head_dim)),
        # so float32 rounding shows more: 1.1e-5 of its scale measured for packed rows.
        tolerance = (3e-5 if name == "gemma4" else 1e-5) * model["scale"]
        assert model["real_tokens"] < tolerance and model["gradients"] < 1e-4, (name, got)
        # Rows of examples packed apart: the kernel's segments are the examples, so each example's
        # outputs are keras-hub's for it alone.
        assert model["packed_examples"] < tolerance, (name, got)
        # The check can fail: a padding query attends other keys under the kernel.
        assert model["padding"] > 1e-2, (name, got)
    # The sliding window's keys are keras-hub's: 128, the query's own included.
    assert got["window_mask_same"] and got["window_keys"] == 128, got
    assert got["routed_on_cpu"] == 0, got  # the kernel is the TPU's: CPU devices keep Keras's


@pytest.mark.slow  # over 15 s: the full suite's (the fast tier keeps within 5 minutes)
def test_generate_on_a_gpt_run_is_deterministic_and_refuses_what_it_cannot_do(tiny_run, tmp_path):
    workdir, _ = tiny_run
    assert_one_line_error(run_command([sys.executable, "-m", "tpu_keras.generate",
                               f"--workdir={tmp_path / 'nowhere'}"], check=False),
                          "holds no training run")
    digits = tmp_path / "digits"
    digits.mkdir()
    config = json.loads((workdir / "config.json").read_text())
    config["model"] = {"name": "mlp"}
    (digits / "config.json").write_text(json.dumps(config))
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "def "}\n{"text": "no prompt"}\n')
    sample = [f"--workdir={workdir}", "--prompt=import ", "--max_length=48", "--seed=7"]
    calls = run_in_one_process("tpu_keras.generate", {  # one start of TensorFlow and keras-hub
        "sample": sample,
        "mlp": [f"--workdir={digits}"],
        "long": [f"--workdir={workdir}", "--prompt=" + "x" * 65],
        "prompts_file": [f"--workdir={workdir}", f"--prompts_file={bad}"]})
    # A rerun in its own process. Its output passes a text-mode pipe, which reads a sampled '\r'
    # as a line break; the batched call's does not: compare line by line.
    texts = [calls["sample"].stdout, generate(workdir, *sample[1:]).stdout]
    assert texts[0].splitlines() == texts[1].splitlines(), texts
    assert texts[0].startswith("import ") and len(texts[0]) > 10, texts
    assert_one_line_error(calls["mlp"], "trained 'mlp', which is not a language model")
    assert_one_line_error(calls["long"], "the prompt is 65 tokens, longer than the model's context of 64")
    assert_one_line_error(calls["prompts_file"], "line 2 of --prompts_file",
                          "an object with a \"prompt\" string")


@pytest.mark.slow
def test_greedy_generate_equals_keras_hub_for_sentencepiece_and_byte_pair_presets(tmp_path):
    """A Llama with a SentencePiece proto and a GPT-2 with byte-pair merges, both written by
    tests/helpers/generate_probe.py: --temperature=0 gives keras-hub's greedy texts, byte for byte."""
    out = run_command([sys.executable, "tests/helpers/generate_probe.py", str(tmp_path)]).stdout
    greedy = json.loads(next(line for line in out.splitlines()
                             if line.startswith("GREEDY "))[len("GREEDY "):])
    prompts = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    # Gemma 3's embedding has rows past its tokenizer's pieces (328 for 321 here, 262,208 for
    # 262,145 released): a hot random draw from the untrained model once picked one, and the
    # tokenizer could not detokenize it.
    hf_pretrained.write(tmp_path / "padded", "gemma3_text")
    calls = run_in_one_process("tpu_keras.generate", {
        **{name: [f"--preset={tmp_path / name}", "--temperature=0",
                  f"--prompts_file={tmp_path / 'prompts.jsonl'}"] for name in ("llama", "gpt2")},
        **{f"padded_{seed}": [f"--preset={tmp_path / 'padded'}", "--temperature=3", "--max_length=60",
                              f"--seed={seed}"] for seed in range(3)}})
    for seed in range(3):
        assert calls[f"padded_{seed}"].returncode == 0, calls[f"padded_{seed}"].stderr[-2000:]
    for name in ("llama", "gpt2"):
        assert calls[name].returncode == 0, calls[name].stderr[-2000:]
        lines = [json.loads(line) for line in calls[name].stdout.splitlines()]
        assert [line["id"] for line in lines] == [prompt["id"] for prompt in prompts]
        assert [line["text"] for line in lines] == greedy[name], (name, lines, greedy[name])
        # Not the prompts alone: the comparison covers generated text.
        assert all(len(text) > len(prompt["prompt"]) for text, prompt in zip(greedy[name], prompts))


@pytest.mark.slow
def test_fine_tuning_guides_lora_recipe_runs(tmp_path):
    guide = (REPO / "docs" / "fine_tuning.md").read_text()
    code = textwrap.dedent(re.search(r"<!-- lora-recipe -->\n *```python\n(.*?) *```", guide,
                                     re.S).group(1))
    assert len([line for line in code.splitlines() if line.strip()]) <= 10
    out = run_command([sys.executable, "-c", code.replace("/tmp/", f"{tmp_path}/")], cwd=tmp_path,
                      timeout=400).stdout
    # Rank 4 on q_proj and v_proj (32 -> 32 each): 4 x (32 + 32) twice, PEFT's count.
    assert re.search(r"model: keras_hub:LlamaCausalLM with [\d,]+ parameters, 512 of them trainable", out), out[-2000:]
    assert re.search(r"done at step 50: val_bits_per_byte \d", out), out[-2000:]


@pytest.mark.slow
def test_a_keras_hub_image_classifier_trains_under_two_replicas(data_dir, tmp_path):
    out = train("configs/digits.py:resnet", tmp_path, f"--config.data.data_dir={data_dir}",
                "--config.cluster.virtual_devices=2", "--config.train.steps=100",
                "--config.train.eval_every=100", "--config.log.every_steps=50",
                "--config.checkpoint.every_steps=100").stdout
    assert "mirrored strategy: 2 replica(s)" in out, out[-2000:]
    assert "model: keras_hub:ResNetImageClassifier with 154,058 parameters" in out, out[-2000:]
    accuracy = float(re.search(r"done at step 100: val_accuracy (\S+)", out).group(1))
    assert accuracy > 0.8, out[-2000:]
