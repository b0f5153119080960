"""Tiny checkpoints of the newer families, written by transformers' own `save_pretrained`.

    write(folder, name)  # name: a key of CHECKPOINTS ('qwen3', 'smollm3', 'gemma3_text', ...)

transformers builds the model from its config class and writes config.json
and model.safetensors as it writes a released checkpoint (the keys its
version writes: `rope_parameters`, `layer_types`, ...); the weights are
drawn again, larger than transformers' initialiser draws them, so that the
logits are far from zero and differences show. The tokenizer files are the
family's, as the Hub ships them: a byte-level BPE's tokenizer.json for Qwen 3
and SmolLM3, and for Gemma 3 also the SentencePiece `tokenizer.model` that
keras-hub's converter reads. Each tokenizer is trained on a few sentences.
"""

import json
import os

import numpy as np

TEXT = ["def main():\n    return 0\n", "import os\nprint(os.getcwd())\n",
        "for i in range(10):\n    print(i * i)\n", "class A:\n    pass\n"] * 4
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 32, 64, 2, 4, 2, 16

# name -> (config class, model class, tokenizer kind, special tokens, the family's own keys,
# the test's changes). Sizes are the same for all; each family's keys are its released ones.
CHECKPOINTS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "bpe", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              {"rms_norm_eps": 1e-6, "tie_word_embeddings": False,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    # Tied as SmolLM3-3B ships; the second layer without rotary positions (NoPE), as every
    # fourth of the 3B's is.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", "bpe",
                ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "no_rope_layers": [1, 0],
                 "head_dim": HIDDEN // HEADS,  # SmolLM3Backbone has no head size of its own
                 "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0}}),
    # Gemma 3's text model, 6 layers: five sliding (a window of 8) and one global, as it ships;
    # Gemma3Backbone makes every sixth layer global, so fewer would hold none.
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", "spm", ["<pad>", "<eos>", "<bos>", "<unk>"],
                    {"num_hidden_layers": 6, "sliding_window": 8, "rms_norm_eps": 1e-6,
                     "query_pre_attn_scalar": HEAD_DIM, "tie_word_embeddings": True}),
    # Gemma 4's text model as its small sizes (E2B, E4B) ship: sliding and global layers (the
    # global ones with heads of their own size and partial rotary positions), per-layer token
    # embeddings, and the last layers reusing earlier layers' keys and values. Four layers, the
    # fewest that hold each: a sliding and a global one, then one of each reusing its kind's.
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", "spm", ["<pad>", "<eos>", "<bos>", "<unk>"],
                    {"num_hidden_layers": 4, "sliding_window": 8, "rms_norm_eps": 1e-6,
                     "layer_types": ["sliding_attention", "full_attention"] * 2,
                     "num_kv_shared_layers": 2,
                     "global_head_dim": 2 * HEAD_DIM, "hidden_size_per_layer_input": 8,
                     "vocab_size_per_layer_input": "vocab_size", "tie_word_embeddings": True}),
    # Qwen 3.5's text model: a Gated DeltaNet (linear attention) layer and a full attention one,
    # the latter with an output gate and a quarter of its head rotated (released sizes have
    # three of the former to one of the latter; two layers are the fewest that hold both).
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "bpe",  # its tokenizer's vision tokens too
                     ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                      "<|image_pad|>", "<|video_pad|>"],
                     {"num_hidden_layers": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                      # keys of 32 features: with 8, keys were so alike that float32's own rounding
                      # in the chunked rule reached 7e-5 of the logits (transformers in float32
                      # against itself in float64); released sizes have 128
                      "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                      "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
                      "layer_types": ["linear_attention", "full_attention"]}),
}
# The mixtures of experts: 8 experts, 2 a token, experts of 32 units (released sizes have
# 128 experts with 8 a token, or 32 with 4); each family's routing keys as it ships them.
EXPERTS, TOP_K, EXPERT_UNITS = 8, 2, 32
MOE_CHECKPOINTS = {
    # Written by transformers 5 with `num_local_experts` (the Hub's checkpoints say `num_experts`)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "bpe", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                  {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_local_experts": EXPERTS,
                   "num_experts_per_tok": TOP_K, "moe_intermediate_size": EXPERT_UNITS, "norm_topk_prob": True,
                   "router_aux_loss_coef": 0.001,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "bpe", ["</s>", "<s>", "<unk>"],
                {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_local_experts": EXPERTS,
                 "head_dim": HIDDEN // HEADS,  # MixtralBackbone has no head size of its own
                 "num_experts_per_tok": TOP_K, "intermediate_size": EXPERT_UNITS, "router_aux_loss_coef": 0.02,
                 "sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", "bpe", ["<|endoftext|>", "<|startoftext|>", "<|return|>"],
                {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_local_experts": EXPERTS,
                 "num_experts_per_tok": TOP_K, "intermediate_size": EXPERT_UNITS, "sliding_window": 8,
                 "layer_types": ["sliding_attention", "full_attention"], "router_aux_loss_coef": 0.9}),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "bpe",
                         ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                          "<|image_pad|>", "<|video_pad|>"],
                         {"num_hidden_layers": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                          "num_experts": EXPERTS, "num_experts_per_tok": TOP_K,
                          "moe_intermediate_size": EXPERT_UNITS, "shared_expert_intermediate_size": EXPERT_UNITS,
                          "router_aux_loss_coef": 0.001,
                          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                          "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
                          "layer_types": ["linear_attention", "full_attention"]}),
    # Gemma 4's 26B-A4B: experts beside a dense MLP in every block, global layers with heads of
    # their own size, no per-layer embeddings; a sliding layer and a global one.
    "gemma4_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM", "spm", ["<pad>", "<eos>", "<bos>", "<unk>"],
                   {"num_hidden_layers": 2, "sliding_window": 8, "rms_norm_eps": 1e-6,
                    "layer_types": ["sliding_attention", "full_attention"], "global_head_dim": 2 * HEAD_DIM,
                    "hidden_size_per_layer_input": 0, "tie_word_embeddings": True, "enable_moe_block": True,
                    "num_experts": EXPERTS, "top_k_experts": TOP_K, "moe_intermediate_size": EXPERT_UNITS}),
}
TASKS = {"qwen3": "Qwen3CausalLM", "smollm3": "SmolLM3CausalLM", "gemma3_text": "Gemma3CausalLM",
         "gemma4_text": "Gemma4CausalLM", "qwen3_5_text": "Qwen3_5CausalLM",
         "qwen3_moe": "Qwen3MoeCausalLM", "mixtral": "MixtralCausalLM", "gpt_oss": "GptOssCausalLM",
         "qwen3_5_moe_text": "Qwen3_5MoeCausalLM", "gemma4_moe": "Gemma4CausalLM"}


def write(folder, name: str, seed: int = 0, **changes) -> dict:
    """Writes the checkpoint `name` (a key of CHECKPOINTS), with `changes` over its config;
    returns its config.json. The vocabulary is padded to a multiple of 8, as real ones are."""
    import torch
    import transformers
    config_cls, model_cls, kind, special, own = {**CHECKPOINTS, **MOE_CHECKPOINTS}[name]
    os.makedirs(folder, exist_ok=True)
    tokens, (pad, bos, eos) = _write_tokenizer(folder, kind, special)
    arguments = dict(vocab_size=-(-tokens // 8) * 8, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                     num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                     head_dim=HEAD_DIM, max_position_embeddings=256, bos_token_id=bos,
                     eos_token_id=eos, pad_token_id=pad)
    arguments.update(own)
    arguments.update(changes)
    arguments.update({key: arguments[value] for key, value in own.items() if value == "vocab_size"})
    config = getattr(transformers, config_cls)(**arguments)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                parameter.copy_((0 if _shifted(config, name) else 1) + 0.1 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / np.sqrt(parameter.shape[-1]))
    model.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as file:
        return json.load(file)


def _shifted(config, name: str) -> bool:
    """Whether the 1-d weight `name` scales by 1 + weight: Gemma's norms, and Qwen 3.5's
    except the Gated DeltaNet's own (its gated norm, decay and time step)."""
    if config.model_type.startswith("gemma"):
        return True
    return config.model_type.startswith("qwen3_5") and "linear_attn" not in name


def write_with_vision(folder, name: str = "gemma4_text") -> dict:
    """The text checkpoint `name` (`gemma4_text`, `qwen3_5_text`), with the config.json of the
    model with its (tiny) vision tower around it, as Gemma 4 and Qwen 3.5 ship (`gemma4`,
    `qwen3_5`: the text model's keys under `text_config`); its weights stay the text model's.
    Returns the config.json."""
    import transformers
    text = write(folder, name)
    if name == "qwen3_5_text":
        vision = transformers.Qwen3_5VisionConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                                  out_hidden_size=HIDDEN)
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision.to_dict()).to_dict()
    else:
        vision = transformers.Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=2, head_dim=8)
        config = transformers.Gemma4Config(text_config=text, vision_config=vision.to_dict()).to_dict()
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(config, file)
    return config


def _write_tokenizer(folder, kind, special) -> tuple[int, tuple[int, int, int]]:
    """The tokenizer files; returns (vocabulary size, (pad, start, end token ids))."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if kind == "bpe":  # Qwen 3, SmolLM3: byte-level BPE, tokenizer.json
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tokenizer.train_from_iterator(TEXT, trainer)
        tokenizer.add_special_tokens(special)
        wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=special[0],
                                                       pad_token=special[0])
        wrapped.save_pretrained(folder)
        first = tokenizer.token_to_id(special[0])
        return tokenizer.get_vocab_size(), (first, first, first)
    # Gemma 3: a SentencePiece model (tokenizer.model) with its 256 byte pieces, pad 0, eos 1,
    # bos 2, unk 3; transformers converts it to its tokenizer.json, and both are kept.
    import sentencepiece
    prefix = os.path.join(folder, "spm")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT * 8), model_prefix=prefix, vocab_size=320, model_type="bpe",
        byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece=special[0],
        eos_piece=special[1], bos_piece=special[2], unk_piece=special[3],
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2)
    os.replace(f"{prefix}.model", os.path.join(folder, "tokenizer.model"))
    os.remove(f"{prefix}.vocab")
    wrapped = transformers.AutoTokenizer.from_pretrained(folder, tokenizer_type="gemma")
    wrapped.save_pretrained(folder)
    pad, end, start = (wrapped.convert_tokens_to_ids(token) for token in special[:3])
    return len(wrapped), (pad, start, end)
