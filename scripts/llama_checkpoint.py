"""Writes a Llama 3 checkpoint as transformers' save_pretrained lays it out, of any size.

    python scripts/llama_checkpoint.py FOLDER [--size=0.85b] [--shard_mib=500]

Random weights in bfloat16 under transformers' names ([out, in] projection
matrices), split into safetensors shards with `model.safetensors.index.json`
beside them, `config.json` (`torch_dtype: bfloat16`) and a small byte-level
BPE `tokenizer.json`. The memory benchmark (`benchmark.py --memory`) and its
test read it as they would read a released checkpoint: nothing here comes
from the toolkit or keras-hub.
"""

import argparse
import json
import os

import numpy as np

# Architectures by name: (hidden, layers, intermediate, heads, key/value heads, vocabulary).
SIZES = {
    "0.85b": (1536, 18, 4096, 12, 4, 128_256),  # 0.85B parameters, 1.59 GiB in bfloat16
    "small": (512, 8, 1536, 8, 4, 32_000),  # 58M, 111 MiB
    "wide": (1024, 2, 16_384, 8, 4, 8_192),  # 126M, 240 MiB, its projections 87%: the memory test's
    "tiny": (256, 4, 512, 4, 2, 8_192),  # 6.6M: the quantization test's
}
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
TEXT = ["def main():\n    return 0\n", "import os\nprint(os.getcwd())\n",
        "for i in range(10):\n    print(i * i)\n", "class A:\n    pass\n"] * 4


def write(folder: str, size: str = "0.85b", shard_mib: int = 500, seed: int = 0) -> dict:
    """Writes the checkpoint; returns {"config": its config, "bytes": its weights' bytes}."""
    import ml_dtypes
    from safetensors.numpy import save_file
    hidden, layers, intermediate, heads, kv_heads, vocabulary = SIZES[size]
    head_dim = hidden // heads
    os.makedirs(folder, exist_ok=True)
    ids = _write_tokenizer(folder)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": vocabulary, "hidden_size": hidden, "intermediate_size": intermediate,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "max_position_embeddings": 8192,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
              "torch_dtype": "bfloat16", "bos_token_id": ids[0], "eos_token_id": ids[1]}
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(config, file, indent=2)
    rng = np.random.default_rng(seed)

    def matrix(rows, columns):
        values = rng.standard_normal((rows, columns), dtype=np.float32) / np.sqrt(columns)
        return values.astype(ml_dtypes.bfloat16)

    def norm():
        return (1 + 0.1 * rng.standard_normal(hidden, dtype=np.float32)).astype(ml_dtypes.bfloat16)

    def tensors():
        yield "model.embed_tokens.weight", lambda: matrix(vocabulary, hidden)
        for i in range(layers):
            layer = f"model.layers.{i}."
            for name, shape in projection_shapes(hidden, intermediate, heads, kv_heads, head_dim).items():
                yield f"{layer}{name}.weight", lambda shape=shape: matrix(*shape)
            yield f"{layer}input_layernorm.weight", norm
            yield f"{layer}post_attention_layernorm.weight", norm
        yield "model.norm.weight", norm
        yield "lm_head.weight", lambda: matrix(vocabulary, hidden)

    shards, shard, shard_bytes, total = [], {}, 0, 0  # shards: each one's tensor names
    for name, make in tensors():  # one shard in memory at a time
        value = make()
        if shard and shard_bytes + value.nbytes > shard_mib * 2**20:
            shards.append(_save_shard(save_file, folder, len(shards) + 1, shard))
            shard, shard_bytes = {}, 0
        shard[name] = value
        shard_bytes += value.nbytes
        total += value.nbytes
    shards.append(_save_shard(save_file, folder, len(shards) + 1, shard))
    # The file names of save_pretrained: model-00001-of-00004.safetensors.
    count, weight_map = len(shards), {}
    for index, names in enumerate(shards, 1):
        final = f"model-{index:05d}-of-{count:05d}.safetensors"
        os.replace(os.path.join(folder, f"shard-{index}.safetensors"), os.path.join(folder, final))
        weight_map.update({name: final for name in names})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as file:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, file, indent=2)
    return {"config": config, "bytes": total}


def _save_shard(save_file, folder, number, shard) -> list:
    save_file(shard, os.path.join(folder, f"shard-{number}.safetensors"), metadata={"format": "pt"})
    return list(shard)


def projection_shapes(hidden, intermediate, heads, kv_heads, head_dim) -> dict:
    """{transformers' name in a Llama-like block: [out, in] shape} of its projections."""
    return {"self_attn.q_proj": (heads * head_dim, hidden),
            "self_attn.k_proj": (kv_heads * head_dim, hidden),
            "self_attn.v_proj": (kv_heads * head_dim, hidden),
            "self_attn.o_proj": (hidden, heads * head_dim),
            "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
            "mlp.down_proj": (hidden, intermediate)}


def train_tokenizer(folder, special):
    """A byte-level BPE, saved as FOLDER/tokenizer.json: the 256 byte symbols, a few merges
    learnt from `TEXT`, the `special` tokens last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(TEXT, trainer)
    tokenizer.add_special_tokens(special)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    return tokenizer


def _write_tokenizer(folder) -> list[int]:
    """Llama 3's special tokens over `train_tokenizer`'s BPE; their ids."""
    tokenizer = train_tokenizer(folder, SPECIAL)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as file:
        json.dump({"bos_token": SPECIAL[0], "eos_token": SPECIAL[1]}, file)
    return [tokenizer.token_to_id(token) for token in SPECIAL]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--size", default="0.85b", choices=sorted(SIZES))
    parser.add_argument("--shard_mib", type=int, default=500)
    arguments = parser.parse_args()
    written = write(arguments.folder, arguments.size, arguments.shard_mib)
    print(json.dumps({"folder": arguments.folder, "bytes": written["bytes"]}))
