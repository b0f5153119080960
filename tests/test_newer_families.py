"""The families people fine-tune now, each a checkpoint transformers' own save_pretrained writes
with its tokenizer files (tests/helpers/hf_pretrained.py): Qwen 3, SmolLM3 (tied, one NoPE
layer), Gemma 3's and Gemma 4's text models (sliding-window layers and global ones;
SentencePiece; Gemma 4 with per-layer token embeddings and layers that reuse earlier ones' keys
and values), Qwen 3.5's (a Gated DeltaNet layer and a full attention one). Their logits are
transformers' own on one device and on a jax mesh, their exports round-trip, a LoRA on every
projection is PEFT's (tests/test_newer_families_on_a_mesh.py), and what keras-hub cannot build
is refused in one line. Modules of their own: xdist's workers take whole modules, and these
runs are as long as the older families' (tests/test_hub_transformers.py)."""

import json

import pytest

from conftest import run_in_one_process, train_args

import hf_checkpoints
from hf_checks import TOLERANCE, TRANSFORMERS, assert_refused, probe
import hf_pretrained

NEWER = tuple(hf_pretrained.CHECKPOINTS)
# Two processes a test; the second group's mesh run took 542 s of a 40-minute suite here, so
# these tests have the probe's own bound, 900 s, rather than pytest's 600.
GROUPS = [("qwen3", "smollm3", "gemma3_text"), ("gemma4_text", "qwen3_5_text")]
assert sorted(sum(GROUPS, ())) == sorted(NEWER)
OWN_LINEAR = {"gemma4_text": ["per_layer_input_gate", "per_layer_model_projection", "per_layer_projection"],
              "qwen3_5_text": ["in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z", "out_proj"]}

# keras-hub's preset read by keras-hub computes Qwen 3.5's Gated DeltaNet with keras-hub's own
# chunked rule, a run with the toolkit's (models/gated_delta_net.py): the same mathematics,
# float32's rounding apart (3.7e-5 of the logit scale measured here on a 2 x 2 mesh).
OWN_RULE = {"qwen3_5_text": TRANSFORMERS}


def relative(result, name, gap: float) -> float:
    """A logit difference of checkpoint `name` relative to its logit scale."""
    return gap / result[name]["scale"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("group", GROUPS, ids=lambda group: "-".join(group))
def test_newer_families_start_from_transformers_logits_evaluate_packed_pairs_and_export_round_trips(
        group, tmp_path, data_dir):
    runs = tuple(f"{name}:{run}" for name in group for run in ("export", "instruct"))
    result = probe("jax", tmp_path, data_dir, "1,1,1", runs, group)
    for name in group:
        assert relative(result, name, result[name]["first_step"]) <= TRANSFORMERS, (name, result[name])
        # generate --preset=FOLDER builds the task and its tokenizer as a run does
        assert relative(result, name, result[name]["generate_preset"]) <= TRANSFORMERS, (name, result[name])
        # evaluate on pairs packed apart: transformers' token mean over each pair alone
        got = result[name]["instruct"]
        assert got["rows"] < got["pairs"] and abs(got["evaluate"] - got["transformers"]) < 1e-4, (name, got)
        checks = result[name]["export"]
        assert checks["problems"] == [] and checks["config"] == {}, (name, checks)
        # transformers reads the export to the toolkit's logits; the toolkit reads it back exactly.
        assert relative(result, name, checks["torch"]) <= TRANSFORMERS, (name, checks)
        assert checks["toolkit"] <= TOLERANCE, (name, checks)


@pytest.mark.slow
def test_checkpoints_the_newer_families_cannot_build_are_one_line(tmp_path):
    """What keras-hub's backbone would build otherwise than transformers: refused, never built."""
    # name -> (checkpoint, its config.json changes, task, more command-line flags)
    cases = {
        "untied_smollm3": ("smollm3", {"tie_word_embeddings": False}, "SmolLM3CausalLM", []),
        "biased_smollm3": ("smollm3", {"attention_bias": True}, "SmolLM3CausalLM", []),
        "windowed_qwen3": ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                           "Qwen3CausalLM", []),
        "scaled_gemma3": ("gemma3_text", {"query_pre_attn_scalar": 32}, "Gemma3CausalLM", []),
        "untied_gemma": ("gemma", {"tie_word_embeddings": False}, "GemmaCausalLM", []),
        "untied_gemma4": ("gemma4_text", {"tie_word_embeddings": False}, "Gemma4CausalLM", []),
        # The older families, audited alike: what keras-hub's Llama-like backbones never build
        "biased_llama": ("llama", {"attention_bias": True}, "Llama3CausalLM", []),
        "gelu_mistral": ("mistral", {"hidden_act": "gelu"}, "MistralCausalLM", []),
        "windowed_qwen2": ("qwen2", {"use_sliding_window": True}, "QwenCausalLM", []),
        "vision_gemma4": ("gemma4_text", "vision", "Gemma4CausalLM", []),
        "vision_qwen3_5": ("qwen3_5_text", "vision", "Qwen3_5CausalLM", []),
        "biased_qwen3_5": ("qwen3_5_text", {"attention_bias": True}, "Qwen3_5CausalLM", []),
        "qwen3_5_target": ("qwen3_5_text", {}, "Qwen3_5CausalLM",
                           ["--config.model.lora_rank=2", "--config.model.lora_targets=conv1d"]),
        "qwen3_target": ("qwen3", {}, "Qwen3CausalLM",
                         ["--config.model.lora_rank=2", "--config.model.lora_targets=q_norm"]),
    }
    calls = {}
    for name, (checkpoint, changes, task, flags) in cases.items():
        folder = tmp_path / name
        if changes == "vision":  # the checkpoint with a vision tower, as Gemma 4 ships
            hf_pretrained.write_with_vision(folder, checkpoint)
        elif checkpoint in hf_pretrained.CHECKPOINTS:
            hf_pretrained.write(folder, checkpoint, **changes)
        else:  # written with numpy: its config.json changed afterwards
            hf_checkpoints.write(folder, checkpoint)
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, **changes}))
        calls[name] = [f"--config=tests/helpers/checkpoint_config.py:{task}",
                       f"--config.model.preset={folder}"] + flags
    layouts = run_in_one_process("tpu_keras.layout", calls)
    assert_refused(layouts["untied_smollm3"], "tie_word_embeddings false",
                   "keras-hub 0.32's SmolLM3Backbone cannot build that model")
    assert_refused(layouts["biased_smollm3"], "biases (attention_bias or mlp_bias)", "SmolLM3Backbone")
    assert_refused(layouts["windowed_qwen3"], "a sliding window on some layers alone", "Qwen3Backbone")
    assert_refused(layouts["untied_gemma"], "tie_word_embeddings false", "GemmaBackbone")
    assert_refused(layouts["qwen3_target"], "model.lora_targets has 'q_norm'", "q_proj, k_proj")
    assert_refused(layouts["untied_gemma4"], "tie_word_embeddings false", "Gemma4Backbone")
    assert_refused(layouts["biased_llama"], "biases (attention_bias or mlp_bias): LlamaBackbone has none")
    assert_refused(layouts["gelu_mistral"], "hidden_act 'gelu': MistralBackbone's MLP is SiLU's")
    assert_refused(layouts["windowed_qwen2"], "use_sliding_window", "QwenBackbone cannot build that model")
    assert_refused(layouts["vision_gemma4"], "a vision or audio tower (model_type 'gemma4')",
                   "(model_type 'gemma4_text') and point model.preset at it")
    assert_refused(layouts["vision_qwen3_5"], "a vision tower (model_type 'qwen3_5')",
                   "(model_type 'qwen3_5_text') and point model.preset at it")
    assert_refused(layouts["biased_qwen3_5"], "biases (attention_bias or mlp_bias): Qwen3_5Backbone has none")
    assert_refused(layouts["qwen3_5_target"], "model.lora_targets has 'conv1d'", "in_proj_qkv")
    assert_refused(layouts["scaled_gemma3"], "query_pre_attn_scalar 32 other than head_dim 16",
                   "Gemma3Backbone cannot build that model")


@pytest.mark.slow
def test_a_preset_whose_tokenizer_cannot_be_read_is_one_line_whatever_tokenizer_the_data_use(
        tmp_path, data_dir):
    """A tokenizer file keras-hub cannot read is refused before the run trains, also where the
    data are bytes: the export carries the preset's tokenizer. Nothing is trained or kept."""
    gemma, qwen = tmp_path / "gemma3_text", tmp_path / "qwen3"
    hf_pretrained.write(gemma, "gemma3_text")
    hf_pretrained.write(qwen, "qwen3")
    (gemma / "tokenizer.model").write_bytes(b"not a SentencePiece model" * 8)  # SentencePiece's
    (qwen / "tokenizer.json").write_text((qwen / "tokenizer.json").read_text()[:200])  # JSON cut short
    text = tmp_path / "code.txt"
    text.write_text("".join(hf_pretrained.TEXT) * 20)
    by_preset = ["--config.data.tfds.name=", f"--config.data.text.files={text}",
                 f"--config.data.text.eval_files={text}", "--config.data.tokens.tokenizer=preset"]
    # Two steps: where a run is not refused, it ends (and its traceback shows) in seconds.
    short = ["--config.train.steps=2", "--config.train.batch_size=4", "--config.train.eval_every=2",
             "--config.train.eval_steps=1", "--config.log.every_steps=1", "--config.checkpoint.every_steps=2"]
    cases = {f"{name}_{data}": (name, task, short + (by_preset if data == "preset" else []))
             for name, task in (("gemma3_text", "Gemma3CausalLM"), ("qwen3", "Qwen3CausalLM"))
             for data in ("bytes", "preset")}
    runs = run_in_one_process("tpu_keras.train", {  # one start: each is refused before it trains
        case: train_args(f"tests/helpers/checkpoint_config.py:{task}", tmp_path / case,
                         f"--config.model.preset={tmp_path / name}", f"--config.data.data_dir={data_dir}",
                         *flags)
        for case, (name, task, flags) in cases.items()})
    for data in ("bytes", "preset"):
        assert_refused(runs[f"gemma3_text_{data}"], "its tokenizer.model cannot be read as a tokenizer",
                       "could not parse ModelProto", "replace it with the checkpoint's own")
        assert_refused(runs[f"qwen3_{data}"], "its tokenizer.json cannot be read as a tokenizer",
                       "replace it with the checkpoint's own")
    for case in cases:
        assert not {"checkpoints", "model", "export"} & {p.name for p in (tmp_path / case).iterdir()}, case
