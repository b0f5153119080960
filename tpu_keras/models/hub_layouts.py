"""The toolkit's layout rules for keras-hub model families.

keras-hub ships `get_layout_map` for a few backbones only, and the maps
that exist have gaps the `Placer` catches (docs/design.md, "keras-hub
layout maps"): Llama's leaves the untied output head
(`token_embedding/reverse_embeddings`, 525M parameters in Llama 3 8B)
replicated on every device, and splits the attention heads over `data` in
the query, key and value kernels but over `model` in the output kernel.
The rules here are Megatron-style tensor parallelism over `model`, as the
`gpt` builder's: heads and MLP units split, one all-reduce per block and
direction, the vocabulary split in the embedding and the head.
"""

from tpu_keras.parallelism import Rule, Tie, replicated

# Backbones whose weights have Llama's paths (checked by tests/test_hub.py).
LLAMA_PATHS = ("LlamaBackbone", "Llama3Backbone", "MistralBackbone")

_LAYER = r"transformer_layer_\d+"


def rules(backbone_cls, config: dict, lora: bool):
    """The rules for `backbone_cls` built from `config`, or None for a family without any."""
    if not _has_llama_paths(backbone_cls):
        return None
    # Shapes: V vocabulary, D hidden_dim, H query heads, G key/value heads, K head size,
    # F intermediate_dim, r the LoRA rank.
    family = [
        # token_embedding/embeddings                                        (V, D)
        Rule(r"token_embedding/embeddings", ("model", None)),
        # transformer_layer_{i}/self_attention/query/kernel                 (D, H, K)
        # transformer_layer_{i}/self_attention/{key,value}/kernel           (D, G, K)
        Rule(rf"{_LAYER}/self_attention/(query|key|value)/kernel", (None, "model", None)),
        # transformer_layer_{i}/self_attention/attention_output/kernel      (H, K, D)
        Rule(rf"{_LAYER}/self_attention/attention_output/kernel", ("model", None, None)),
        # transformer_layer_{i}/feedforward_{intermediate,gate}_dense/kernel  (D, F)
        Rule(rf"{_LAYER}/feedforward_(intermediate|gate)_dense/kernel", (None, "model")),
        # transformer_layer_{i}/feedforward_output_dense/kernel             (F, D)
        Rule(rf"{_LAYER}/feedforward_output_dense/kernel", ("model", None)),
        # transformer_layer_{i}/{self_attention,feedforward}_layernorm/scale,
        # sequence_output_layernorm/scale                                   (D,)
        replicated(rf"({_LAYER}/(self_attention|feedforward)_layernorm|sequence_output_layernorm)/scale"),
    ]
    if not config.get("tie_word_embeddings", False):
        # token_embedding/reverse_embeddings: the untied output head        (D, V)
        family.append(Rule(r"token_embedding/reverse_embeddings", (None, "model")))
    if lora:
        # LoRA factors of the query and value kernels live with their heads:
        # transformer_layer_{i}/self_attention/{query,value}/lora_kernel_a  (D, H or G, r)
        # transformer_layer_{i}/self_attention/{query,value}/lora_kernel_b  (r, K)
        family += [Rule(rf"{_LAYER}/self_attention/(query|value)/lora_kernel_a", (None, "model", None)),
                   replicated(rf"{_LAYER}/self_attention/(query|value)/lora_kernel_b")]
    return family


def ties(backbone_cls) -> list[Tie]:
    """Dimensions that must be split alike, whatever rules are in use."""
    if not _has_llama_paths(backbone_cls):
        return []
    return [
        Tie("attention heads", ((rf"{_LAYER}/self_attention/(query|key|value)/kernel", 1),
                                (rf"{_LAYER}/self_attention/attention_output/kernel", 0),
                                (rf"{_LAYER}/self_attention/(query|value)/lora_kernel_a", 1))),
        Tie("MLP units", ((rf"{_LAYER}/feedforward_(intermediate|gate)_dense/kernel", 1),
                          (rf"{_LAYER}/feedforward_output_dense/kernel", 0))),
    ]


def _has_llama_paths(backbone_cls) -> bool:
    return any(cls.__name__ in LLAMA_PATHS for cls in backbone_cls.__mro__)
