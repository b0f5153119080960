"""Mixtral (keras-hub's MixtralBackbone): transformers' `mixtral`.

Mistral's attention (the head size hidden / heads) with a mixture of experts
in place of the MLP: a router (`sparse_feedforward_gate_dense`, hidden x
experts) that always rescales its top-k weights to sum to one, and an expert
bank of gate, up and output kernels apart (transformers' `w1`, `w3`, `w2`).
The jax engine computes the experts sparsely (`models.moe`).

keras-hub 0.32 has no transformers exporter for it (a run ended at its export
before this family); the config and weights maps are the toolkit's, each
expert written apart under `block_sparse_moe`, as transformers 5 writes them.
The converter reads no rope scaling, and applies Mistral's sliding window
only where Keras has no fused attention: a checkpoint with either is refused.
LoRA: PEFT's names on the attention projections.
"""

# Imported inside functions: keras-hub (optional: absent on a plain install).
from tpu_keras.models.families import experts, llama
from tpu_keras.models.families.family import (Family, no_rope_scaling, refuse_first, register,
                                              unbuilt_llama_parts)
from tpu_keras.parallelism import Rule

LAYER = llama.LAYER
BLOCK = rf"{LAYER}/mixtral_sparse_moe_block(_\d+)?"  # Keras numbers a second one built in a process


def layout(config: dict) -> list[Rule]:
    """Llama's rules for attention, norms and the vocabulary, and (E experts, H hidden,
    F units): the router (H, E) whole; gate and up (E, H, F) over `expert` and, their units,
    `model`; the output (E, F, H) over both too."""
    return experts.without_dense_mlp(llama.layout(config)) + experts.rules(
        rf"{BLOCK}/sparse_feedforward_gate_dense/kernel",
        [(rf"{BLOCK}/experts/expert_feedforward_(gate|intermediate)_dense", ("expert", None, "model"))],
        rf"{BLOCK}/experts/expert_feedforward_output_dense")


def read_config(config: dict) -> dict:
    no_rope_scaling(config)
    head_dim = config.get("head_dim")
    refuse_first([
        (head_dim and head_dim != config["hidden_size"] // config["num_attention_heads"],
         f"head_dim {head_dim} is not hidden_size / num_attention_heads"),
        (config.get("sliding_window"), f"sliding_window {config.get('sliding_window')}, which keras-hub "
         "0.32's MixtralAttention leaves out of its fused attention (the jax engine's)"),
        *unbuilt_llama_parts(config, "MixtralBackbone"),
    ])
    return {}


def transformers_config(backbone) -> dict:
    """MixtralForCausalLM's config.json, in transformers 5's keys; a run from a checkpoint
    keeps the checkpoint's own keys over these (`export`)."""
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": backbone.vocabulary_size, "hidden_size": backbone.hidden_dim,
        "intermediate_size": backbone.intermediate_dim, "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_query_heads,
        "num_key_value_heads": backbone.num_key_value_heads,
        "head_dim": backbone.hidden_dim // backbone.num_query_heads,
        "num_local_experts": backbone.num_experts, "num_experts_per_tok": backbone.top_k,
        "router_aux_loss_coef": backbone.router_aux_loss_coef,
        "router_jitter_noise": backbone.router_jitter_noise,
        "hidden_act": "silu", "rms_norm_eps": backbone.layer_norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": backbone.rope_max_wavelength},
        "attention_dropout": 0.0, "sliding_window": None, "tie_word_embeddings": False,
        "max_position_embeddings": 32768,  # Mixtral's; a run from a checkpoint keeps the checkpoint's
        "use_cache": True,
    }


def transformers_weights(backbone, include_lm_head=False) -> dict:
    """Each block's attention, norms, router (`block_sparse_moe.gate`) and experts (`w1` gate,
    `w3` up, `w2` output), by transformers' names."""
    from keras import ops
    weights = experts.outer_weights(backbone, include_lm_head)
    for i in range(backbone.num_layers):
        block = backbone.get_layer(f"transformer_layer_{i}")
        prefix, moe = f"model.layers.{i}", block._sparse_moe_block
        weights.update(experts.attention_weights(backbone, i, block._self_attention_layer, (
            "query_dense", "key_dense", "value_dense", "output_dense")))
        weights[f"{prefix}.input_layernorm.weight"] = block._self_attention_layernorm.scale
        weights[f"{prefix}.post_attention_layernorm.weight"] = block._feedforward_layernorm.scale
        weights[f"{prefix}.block_sparse_moe.gate.weight"] = ops.transpose(moe._sparse_feedforward_gate_dense.kernel)
        bank = moe.expert_bank
        for name, stacked in (("w1", bank._expert_feedforward_gate_dense),
                              ("w3", bank._expert_feedforward_intermediate_dense),
                              ("w2", bank._expert_feedforward_output_dense)):
            weights.update(experts.per_expert(stacked, f"{prefix}.block_sparse_moe.experts.{{}}.{name}.weight"))
    return weights


FAMILY = register(Family(
    name="mixtral",
    backbones=("MixtralBackbone",),
    attention=("MixtralAttention",),
    fused_attention=("MixtralAttention",),
    model_types=("mixtral",),
    read_config=read_config,
    layout=layout,
    ties=llama.TIES[:1],
    lora_targets=llama.LORA_TARGETS[:4],
    transformers_config=transformers_config,
    transformers_weights=transformers_weights,
))
