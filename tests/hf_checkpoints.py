"""Small transformers-format checkpoints, written as Hugging Face lays them out on disk.

    write(folder, family)  # family: 'llama' (Llama 3) or 'qwen2'

config.json with `model_type`, model.safetensors (random float32 weights
under transformers' own names, [out, in] projection matrices) and a
byte-level BPE tokenizer.json that the `tokenizers` library trains on a few
sentences (with tokenizer_config.json naming the start and end tokens).
Nothing here comes from keras-hub: its loader must read these folders as
it reads a real checkpoint.
"""

import json
import os

import numpy as np

SPECIAL = {"llama": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                     "<|end_header_id|>"],
           "qwen2": ["<|endoftext|>"]}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2
TEXT = ["def main():\n    return 0\n", "import os\nprint(os.getcwd())\n",
        "for i in range(10):\n    print(i * i)\n", "class A:\n    pass\n"] * 4


def write(folder, family: str, seed: int = 0) -> int:
    """Writes the checkpoint; returns its vocabulary size (a multiple of 8, so that a mesh
    axis of 2, 4 or 8 splits the embedding)."""
    os.makedirs(folder, exist_ok=True)
    tokens, ids = _write_tokenizer(folder, family)
    vocabulary_size = -(-tokens // 8) * 8  # rows past the tokenizer's, as real checkpoints pad
    config = {
        "architectures": [ARCHITECTURES[family]], "model_type": family,
        "vocab_size": vocabulary_size, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "max_position_embeddings": 256, "hidden_act": "silu", "torch_dtype": "float32",
    }
    if family == "qwen2":
        config.update(use_sliding_window=False, sliding_window=256, eos_token_id=ids[0])
    else:
        config.update(bos_token_id=ids[0], eos_token_id=ids[1])
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(config, file, indent=2)
    _write_weights(folder, family, vocabulary_size, seed)
    return vocabulary_size


def _write_weights(folder, family, vocabulary_size, seed):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def matrix(rows, columns):
        return (rng.standard_normal((rows, columns)) / np.sqrt(columns)).astype("float32")

    def norm():
        return (1 + 0.1 * rng.standard_normal(HIDDEN)).astype("float32")

    weights = {"model.embed_tokens.weight": matrix(vocabulary_size, HIDDEN),
               "lm_head.weight": matrix(vocabulary_size, HIDDEN), "model.norm.weight": norm()}
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (HEADS * head_dim, HIDDEN),
                  "self_attn.k_proj": (KV_HEADS * head_dim, HIDDEN),
                  "self_attn.v_proj": (KV_HEADS * head_dim, HIDDEN),
                  "self_attn.o_proj": (HIDDEN, HEADS * head_dim),
                  "mlp.gate_proj": (INTERMEDIATE, HIDDEN), "mlp.up_proj": (INTERMEDIATE, HIDDEN),
                  "mlp.down_proj": (HIDDEN, INTERMEDIATE)}
        for name, shape in shapes.items():
            weights[f"{layer}{name}.weight"] = matrix(*shape)
            if family == "qwen2" and name in ("self_attn.q_proj", "self_attn.k_proj",
                                              "self_attn.v_proj"):
                weights[f"{layer}{name}.bias"] = (0.1 * rng.standard_normal(shape[0])).astype("float32")
        weights[f"{layer}input_layernorm.weight"] = norm()
        weights[f"{layer}post_attention_layernorm.weight"] = norm()
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _write_tokenizer(folder, family) -> tuple[int, list[int]]:
    """A byte-level BPE: the 256 byte symbols, a few merges, the family's special tokens last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(TEXT, trainer)
    tokenizer.add_special_tokens(SPECIAL[family])
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    special = SPECIAL[family]
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as file:
        json.dump({"bos_token": special[0] if family == "llama" else None,
                   "eos_token": special[1] if family == "llama" else special[0]}, file)
    return tokenizer.get_vocab_size(), [tokenizer.token_to_id(token) for token in special]
