"""Llama (keras-hub's LlamaBackbone) and Llama 3, 3.1, 3.2 (Llama3Backbone): transformers' `llama`.

Layout: Megatron-style tensor parallelism over `model`, as the `gpt`
builder's: heads and MLP units split, one all-reduce per block and direction,
the vocabulary split in the embedding and the untied head. keras-hub's own
`get_layout_map` leaves that head (`token_embedding/reverse_embeddings`, 525M
parameters in Llama 3 8B) whole on every device, and splits the heads over
`data` in the query, key and value kernels but over `model` in the output
kernel.
"""

from tpu_keras.models.families.family import (Family, Target, Unreadable, refuse_first, register,
                                              rope_parameters, rope_type, unbuilt_llama_parts)
from tpu_keras.parallelism import Rule, Tie, replicated

LAYER = r"transformer_layer_\d+"


def layout(config: dict) -> list[Rule]:
    """Shapes: V vocabulary, D hidden_dim, H query heads, G key/value heads, K head size,
    F intermediate_dim. Mistral's and Qwen's weights have the same paths."""
    rules = [
        # token_embedding/embeddings                                        (V, D)
        Rule(r"token_embedding/embeddings", ("model", None)),
        # transformer_layer_{i}/self_attention/query/kernel                 (D, H, K)
        # transformer_layer_{i}/self_attention/{key,value}/kernel           (D, G, K)
        Rule(rf"{LAYER}/self_attention/(query|key|value)/kernel", (None, "model", None)),
        # transformer_layer_{i}/self_attention/attention_output/kernel      (H, K, D)
        Rule(rf"{LAYER}/self_attention/attention_output/kernel", ("model", None, None)),
        # transformer_layer_{i}/feedforward_{intermediate,gate}_dense/kernel  (D, F)
        Rule(rf"{LAYER}/feedforward_(intermediate|gate)_dense/kernel", (None, "model")),
        # transformer_layer_{i}/feedforward_output_dense/kernel             (F, D)
        Rule(rf"{LAYER}/feedforward_output_dense/kernel", ("model", None)),
        # transformer_layer_{i}/{self_attention,feedforward}_layernorm/scale,
        # sequence_output_layernorm/scale                                   (D,)
        replicated(rf"({LAYER}/(self_attention|feedforward)_layernorm|sequence_output_layernorm)/scale"),
    ]
    if not config.get("tie_word_embeddings", False):
        # token_embedding/reverse_embeddings: the untied output head        (D, V)
        rules.append(Rule(r"token_embedding/reverse_embeddings", (None, "model")))
    return rules


TIES = (
    Tie("attention heads", ((rf"{LAYER}/self_attention/(query|key|value)/kernel", 1),
                            (rf"{LAYER}/self_attention/attention_output/kernel", 0))),
    Tie("MLP units", ((rf"{LAYER}/feedforward_(intermediate|gate)_dense/kernel", 1),
                      (rf"{LAYER}/feedforward_output_dense/kernel", 0))),
)

# PEFT's module names, the Keras layers, transformers' modules. Kernels: query, key and value
# (D, heads, K) read D; the attention output (H, K, D) reads H x K; the MLP's are Dense.
_BLOCK, _MODULE = "transformer_layer_{i}", "model.layers.{i}"
LORA_TARGETS = (
    Target("q_proj", f"{_BLOCK}/self_attention/query", f"{_MODULE}.self_attn.q_proj"),
    Target("k_proj", f"{_BLOCK}/self_attention/key", f"{_MODULE}.self_attn.k_proj"),
    Target("v_proj", f"{_BLOCK}/self_attention/value", f"{_MODULE}.self_attn.v_proj"),
    Target("o_proj", f"{_BLOCK}/self_attention/attention_output", f"{_MODULE}.self_attn.o_proj",
           inputs=(0, 1)),
    Target("gate_proj", f"{_BLOCK}/feedforward_gate_dense", f"{_MODULE}.mlp.gate_proj"),
    Target("up_proj", f"{_BLOCK}/feedforward_intermediate_dense", f"{_MODULE}.mlp.up_proj"),
    Target("down_proj", f"{_BLOCK}/feedforward_output_dense", f"{_MODULE}.mlp.down_proj"),
)

# Llama 3.1's rope scaling, as Llama3Backbone takes it.
_LLAMA3_ROPE = {"factor": "rope_frequency_adjustment_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor",
                "original_max_position_embeddings": "rope_pretraining_sequence_length"}


def read_config(config: dict) -> dict:
    """Llama 3.1's rope scaling: keras-hub 0.32 reads `rope_scaling`, and transformers 5's
    save_pretrained writes it as `rope_parameters` (rope_theta inside)."""
    kind = rope_type(config)
    arguments = {}
    if kind == "llama3":
        rope = rope_parameters(config)
        arguments.update({argument: rope[key] for key, argument in _LLAMA3_ROPE.items()})
    elif kind != "default":
        raise Unreadable(f"rope_type {kind!r} (Llama3Backbone has 'llama3', Llama 3.1's, alone)")
    head_dim = config.get("head_dim")
    refuse_first([(head_dim and head_dim != config["hidden_size"] // config["num_attention_heads"],
                   f"head_dim {head_dim} is not hidden_size / num_attention_heads"),
                  *unbuilt_llama_parts(config, "LlamaBackbone")])
    return arguments


FAMILY = register(Family(
    name="llama",
    backbones=("LlamaBackbone", "Llama3Backbone"),
    attention=("LlamaAttention",),
    model_types=("llama",),
    # keras-hub 0.32's converter leaves it out: Llama 3's 1e-5 became the backbone's 1e-6,
    # 3e-3 off transformers' logits, and the transformers export then said 1e-06.
    converter_keys={"rms_norm_eps": "layer_norm_epsilon"},
    read_config=read_config,
    layout=layout,
    ties=TIES,
    lora_targets=LORA_TARGETS,
    fused_attention=("LlamaAttention",),
))
