"""Qwen3-MoE (keras-hub's Qwen3MoeBackbone): transformers' `qwen3_moe`.

Qwen 3's attention (query and key norms, a head size of its own) with a
mixture of experts in place of the MLP: a router (`sparse_feedforward_gate_dense`,
hidden x experts) and an expert bank, gate and up fused along the units
(experts x hidden x 2 units, the gate first) and the output (experts x units x
hidden). The jax engine computes the experts sparsely (`models.moe`).

Reading: the Hub's checkpoints say `num_experts`, transformers 5's
save_pretrained writes `num_local_experts`; keras-hub 0.32's converter reads
the former alone (`config_aliases`). Dense MLP layers between the experts
(`mlp_only_layers`, `decoder_sparse_step`), which no released size has, are
refused. LoRA: PEFT's names on the attention projections, and its
`target_parameters` on the experts (`experts.fused_bank_targets`); keras-hub 0.32 has
no transformers exporter for the model, so the config and weights maps are the
toolkit's (each expert written apart, as transformers 5 writes them).
"""

# Imported inside functions: keras-hub (optional: absent on a plain install).
from tpu_keras.models.families import experts, llama, qwen3
from tpu_keras.models.families.family import Family, refuse_first, register
from tpu_keras.parallelism import Rule

LAYER = llama.LAYER
BLOCK = rf"{LAYER}/qwen3_sparse_moe_block(_\d+)?"  # Keras numbers a second one built in a process


def layout(config: dict) -> list[Rule]:
    """Qwen 3's rules for attention, norms and the vocabulary (every block's MLP is experts),
    and (E experts, H hidden, F units): the router (H, E) whole; gate and up fused (E, H, 2F)
    over `expert` alone (their units split over `model` would pair one device's gates with
    another's ups); the output (E, F, H) over `expert` and `model`."""
    return experts.without_dense_mlp(qwen3.layout(config)) + experts.rules(
        rf"{BLOCK}/sparse_feedforward_gate_dense/kernel",
        [(rf"{BLOCK}/experts/expert_feedforward_gate_dense", ("expert", None, None))],
        rf"{BLOCK}/experts/expert_feedforward_output_dense")


def read_config(config: dict) -> dict:
    qwen3.read_config(config)
    step = config.get("decoder_sparse_step", 1)
    refuse_first([(config.get("mlp_only_layers") or step != 1,
                   f"dense MLP layers between the experts (mlp_only_layers "
                   f"{config.get('mlp_only_layers')}, decoder_sparse_step {step}), which no released "
                   "Qwen3-MoE has and the toolkit's rules do not lay out")])
    return {}


def transformers_config(backbone) -> dict:
    """Qwen3MoeForCausalLM's config.json, in transformers 5's keys; a run from a checkpoint
    keeps the checkpoint's own keys over these (`export`)."""
    window = backbone.sliding_window_size
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": backbone.vocabulary_size, "hidden_size": backbone.hidden_dim,
        "intermediate_size": backbone.intermediate_dim,
        "moe_intermediate_size": backbone.moe_intermediate_dim,
        "num_hidden_layers": backbone.num_layers, "num_attention_heads": backbone.num_query_heads,
        "num_key_value_heads": backbone.num_key_value_heads, "head_dim": backbone.head_dim,
        "num_local_experts": backbone.num_experts, "num_experts_per_tok": backbone.top_k,
        "norm_topk_prob": backbone.norm_top_k_prob, "decoder_sparse_step": backbone.decoder_sparse_step,
        "mlp_only_layers": list(backbone.mlp_only_layers),
        "router_aux_loss_coef": backbone.router_aux_loss_coefficient,
        "hidden_act": "silu", "rms_norm_eps": backbone.layer_norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": backbone.rope_max_wavelength},
        "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": backbone.tie_word_embeddings,
        "use_sliding_window": bool(window), "sliding_window": window,
        "max_position_embeddings": 40960,  # Qwen3-MoE's; a run from a checkpoint keeps the checkpoint's
        "use_cache": True,
    }


def transformers_weights(backbone, include_lm_head=False) -> dict:
    """Each block's attention, norms, router and experts (gate and up apart), by transformers'
    names."""
    from keras import ops
    weights = experts.outer_weights(backbone, include_lm_head)
    for i in range(backbone.num_layers):
        block = backbone.get_layer(f"transformer_layer_{i}")
        attention, prefix = block._self_attention_layer, f"model.layers.{i}"
        weights.update(experts.attention_weights(backbone, i, attention))
        weights[f"{prefix}.self_attn.q_norm.weight"] = attention._query_dense_layer_norm.scale
        weights[f"{prefix}.self_attn.k_norm.weight"] = attention._key_dense_layer_norm.scale
        weights[f"{prefix}.input_layernorm.weight"] = block._self_attention_layernorm.scale
        weights[f"{prefix}.post_attention_layernorm.weight"] = block._feedforward_layernorm.scale
        mlp = block.mlp
        weights[f"{prefix}.mlp.gate.weight"] = ops.transpose(mlp._sparse_feedforward_gate_dense.kernel)
        weights.update(experts.fused_bank_weights(mlp.expert_bank, f"{prefix}.mlp"))
    return weights


FAMILY = register(Family(
    name="qwen3_moe",
    backbones=("Qwen3MoeBackbone",),
    attention=("Qwen3MoeAttention",),
    fused_attention=("Qwen3MoeAttention",),
    model_types=("qwen3_moe",),
    config_aliases={"num_experts": "num_local_experts"},
    read_config=read_config,
    layout=layout,
    ties=llama.TIES[:1],
    lora_targets=llama.LORA_TARGETS[:4],
    expert_targets=experts.fused_bank_targets("transformer_layer_{i}/qwen3_sparse_moe_block{n}"),
    transformers_config=transformers_config,
    transformers_weights=transformers_weights,
    transformers_tokenizer=qwen3.transformers_tokenizer,
))
