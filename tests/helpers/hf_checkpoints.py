"""Small transformers-format checkpoints, written as Hugging Face lays them out on disk, and read back.

    write(folder, name)  # name: a key of CHECKPOINTS ('llama', 'llama31', 'qwen2', ...)
    transformers_logits(folder, tokens, adapter=None)  # transformers' own model, PEFT's adapter on it

config.json with `model_type`, model.safetensors (random float32 weights, or
bfloat16 ones as most hub checkpoints ship, under transformers' own names,
[out, in] projection matrices) and a
byte-level BPE tokenizer.json that the `tokenizers` library trains on a few
sentences (with tokenizer_config.json naming the start and end tokens).
Nothing here comes from keras-hub: its loader must read these folders as
it reads a real checkpoint. Each family's config keys are those its real
checkpoints ship (Llama 3's `rms_norm_eps` of 1e-5, Gemma's tied head and
`head_dim`, ...), since keras-hub's converters must not assume them.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import llama_checkpoint  # noqa: E402  (its BPE tokenizer and Llama block, shared)

# The checkpoints of the tests: name -> (model_type, config keys over the family's own).
# Those the tests only read and export have one layer (on a jax mesh each weight's first
# value is a program of its own to compile); the two they train have two.
CHECKPOINTS = {
    "llama": ("llama", {}),  # Llama 3
    # Llama 3.1 and 3.2: llama3 rope scaling, and (3.2 1B and 3B) the head tied to the
    # embedding. A short original context (16), so that the scaling changes the logits.
    "llama31": ("llama", {"num_hidden_layers": 1, "tie_word_embeddings": True, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    # The same as transformers 5's save_pretrained writes it: `rope_parameters`, with
    # rope_theta inside, where hub checkpoints have `rope_scaling` and `rope_theta`.
    "llama31_rope_parameters": ("llama", {"num_hidden_layers": 1, "tie_word_embeddings": True,
                                          "rope_theta": None, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen2": ("qwen2", {}),
    "gemma": ("gemma", {"num_hidden_layers": 1}),
    # head_dim 16 over 4 heads of a hidden size 32: as Mistral NeMo's 128 over 32 of 5120.
    "mistral": ("mistral", {"num_hidden_layers": 1, "head_dim": 16}),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gemma": "GemmaForCausalLM", "mistral": "MistralForCausalLM"}
SPECIAL = {"llama": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                     "<|end_header_id|>"],
           "qwen2": ["<|endoftext|>"], "gemma": ["<bos>", "<eos>"], "mistral": ["<s>", "</s>"]}
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2
# Each family's own keys, as its released checkpoints have them.
FAMILY = {
    "llama": {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
              "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 256},
    "gemma": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
              "head_dim": HIDDEN // HEADS, "hidden_act": "gelu_pytorch_tanh",
              "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False},
    "mistral": {"rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": False,
                "hidden_act": "silu", "sliding_window": None},
}
TEXT = llama_checkpoint.TEXT


def transformers_logits(folder, tokens, adapter=None):
    """The float32 logits of transformers' own model of `folder` for `tokens`, with the PEFT
    adapter in the folder `adapter` read onto it (PEFT's `PeftModel`) where given."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter:
        import peft
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def write(folder, name: str, seed: int = 0, dtype: str = "float32") -> dict:
    """Writes the checkpoint `name` (a key of CHECKPOINTS), its weights in `dtype` ('float32',
    'bfloat16'); returns its config. The vocabulary is a multiple of 8, so that a mesh axis
    of 2, 4 or 8 splits the embedding."""
    family, changes = CHECKPOINTS[name]
    os.makedirs(folder, exist_ok=True)
    tokens, ids = _write_tokenizer(folder, family)
    vocabulary_size = -(-tokens // 8) * 8  # rows past the tokenizer's, as real checkpoints pad
    config = {
        "architectures": [ARCHITECTURES[family]], "model_type": family,
        "vocab_size": vocabulary_size, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 256, "torch_dtype": dtype, **FAMILY[family],
        "bos_token_id": ids[0], "eos_token_id": ids[1] if len(ids) > 1 else ids[0],
    }
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not None or key == "sliding_window"}
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(config, file, indent=2)
    _write_weights(folder, config, seed, dtype)
    return config


def _write_weights(folder, config, seed, dtype):
    import ml_dtypes
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    family = config["model_type"]
    head_dim = config.get("head_dim", HIDDEN // HEADS)
    vocabulary_size = config["vocab_size"]

    def matrix(rows, columns):
        return (rng.standard_normal((rows, columns)) / np.sqrt(columns)).astype("float32")

    def norm():
        if family == "gemma":  # Gemma scales by 1 + weight
            return (0.1 * rng.standard_normal(HIDDEN)).astype("float32")
        return (1 + 0.1 * rng.standard_normal(HIDDEN)).astype("float32")

    weights = {"model.embed_tokens.weight": matrix(vocabulary_size, HIDDEN), "model.norm.weight": norm()}
    if not config["tie_word_embeddings"]:  # a tied checkpoint has no lm_head
        weights["lm_head.weight"] = matrix(vocabulary_size, HIDDEN)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes = llama_checkpoint.projection_shapes(HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, head_dim)
        for name, shape in shapes.items():
            weights[f"{layer}{name}.weight"] = matrix(*shape)
            if family == "qwen2" and name in ("self_attn.q_proj", "self_attn.k_proj",
                                              "self_attn.v_proj"):
                weights[f"{layer}{name}.bias"] = (0.1 * rng.standard_normal(shape[0])).astype("float32")
        weights[f"{layer}input_layernorm.weight"] = norm()
        weights[f"{layer}post_attention_layernorm.weight"] = norm()
    stored = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype  # the same values, rounded
    save_file({key: value.astype(stored) for key, value in weights.items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _write_tokenizer(folder, family) -> tuple[int, list[int]]:
    """The family's special tokens over a small byte-level BPE (`llama_checkpoint.train_tokenizer`)."""
    special = SPECIAL[family]
    tokenizer = llama_checkpoint.train_tokenizer(folder, special)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as file:
        json.dump({"bos_token": None if family == "qwen2" else special[0],
                   "eos_token": special[0] if family == "qwen2" else special[1]}, file)
    return tokenizer.get_vocab_size(), [tokenizer.token_to_id(token) for token in special]
