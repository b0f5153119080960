"""Qwen 3.5's mixture of experts (keras-hub's Qwen3_5MoeBackbone), its text model:
transformers' `qwen3_5_moe_text`.

Qwen 3.5's hybrid attention (`qwen3_5`: Gated DeltaNet blocks and gated full
attention) with a mixture of experts in place of every MLP: a router
(`router_gate`, hidden x experts) whose top-k weights always sum to one, an
expert bank (gate and up fused along the units, the gate first), and a shared
expert (a SiLU MLP) gated by a sigmoid of its own projection. The jax engine
computes the routed experts sparsely (`models.moe`); the shared expert runs
on every token, as transformers runs it.

Reading: as `qwen3_5`'s text model, keras-hub 0.32's loader knows the model
by its composite `model_type` alone (`qwen3_5_moe`, weights under
`model.language_model.`); `converter_model_types` and `converter_prefixes`
let its converter read the text model transformers' `Qwen3_5MoeForCausalLM`
writes. Export: keras-hub 0.32 has no transformers exporter for the model;
the config and weights maps are the toolkit's, each expert written apart, as
transformers 5 writes them. LoRA: `qwen3_5`'s names on the attention and the
linear attention (PEFT has no defaults for the model; ours are `q_proj`,
`v_proj`), and PEFT's `target_parameters` on the experts
(`experts.fused_bank_targets`).
"""

# Imported inside functions: keras (optional to import here: only exports need it).
from tpu_keras.models.families import experts, qwen3, qwen3_5
from tpu_keras.models.families.family import Family, Unreadable, register
from tpu_keras.parallelism import Rule, replicated

LAYER = qwen3_5.LAYER
BLOCK = rf"{LAYER}/sparse_moe_block"
_COMPOSITE, _TEXT = "model.language_model.", "model."


def layout(config: dict) -> list[Rule]:
    """Qwen 3.5's rules for attention, linear attention, norms and the vocabulary, and (E
    experts, H hidden, F units): the router (H, E) whole; gate and up fused (E, H, 2F) over
    `expert` alone (their units split over `model` would pair one device's gates with
    another's ups); the output (E, F, H) over `expert` and `model`; the shared expert's
    units over `model`, as a dense MLP's, its gate (H, 1) whole."""
    shared = rf"{BLOCK}/shared_expert"
    return experts.without_dense_mlp(qwen3_5.layout(config)) + experts.rules(
        rf"{BLOCK}/router_gate/kernel",
        [(rf"{BLOCK}/experts/expert_feedforward_gate_dense", ("expert", None, None))],
        rf"{BLOCK}/experts/expert_feedforward_output_dense") + [
        Rule(rf"{shared}/feedforward_(intermediate|gate)_dense/kernel", (None, "model")),
        Rule(rf"{shared}/feedforward_output_dense/kernel", ("model", None)),
        replicated(rf"{BLOCK}/shared_expert_gate/kernel"),
    ]


def read_config(config: dict) -> dict:
    if config.get("model_type") == "qwen3_5_moe" and config.get("vision_config"):
        raise Unreadable("a vision tower (model_type 'qwen3_5_moe'): the toolkit trains Qwen 3.5's "
                         "text model; save Qwen3_5MoeForConditionalGeneration's language model alone "
                         "(model_type 'qwen3_5_moe_text') and point model.preset at it")
    text = config.get("text_config") or config
    if text.get("mlp_only_layers"):
        raise Unreadable(f"dense MLP layers between the experts (mlp_only_layers "
                         f"{text['mlp_only_layers']}), which Qwen3_5MoeBackbone does not build")
    # Qwen 3.5's own checks, less the dense model's refusal of experts.
    return qwen3_5.read_config({**text, "num_experts": None, "model_type": "qwen3_5_text"})


def transformers_config(backbone) -> dict:
    """Qwen3_5MoeForCausalLM's config.json, in transformers 5's keys; a run from a checkpoint
    keeps the checkpoint's own keys over these (`export`)."""
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "vocab_size": backbone.vocabulary_size, "hidden_size": backbone.hidden_dim,
        "num_hidden_layers": backbone.num_layers, "num_attention_heads": backbone.num_query_heads,
        "num_key_value_heads": backbone.num_key_value_heads, "head_dim": backbone.head_dim,
        "moe_intermediate_size": backbone.moe_intermediate_dim,
        "shared_expert_intermediate_size": backbone.shared_expert_intermediate_size,
        "num_experts": backbone.num_experts, "num_experts_per_tok": backbone.top_k,
        "router_aux_loss_coef": backbone.router_aux_loss_coefficient,
        "rms_norm_eps": backbone.layer_norm_epsilon, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": backbone.rope_max_wavelength,
                            "partial_rotary_factor": backbone.partial_rotary_factor},
        "layer_types": list(backbone.layer_types),
        "linear_num_key_heads": backbone.linear_num_key_heads,
        "linear_num_value_heads": backbone.linear_num_value_heads,
        "linear_key_head_dim": backbone.linear_key_head_dim,
        "linear_value_head_dim": backbone.linear_value_head_dim,
        "linear_conv_kernel_dim": backbone.linear_conv_kernel_dim,
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "tie_word_embeddings": backbone.tie_word_embeddings,
        "max_position_embeddings": 262144,  # Qwen 3.5's; a run from a checkpoint keeps the checkpoint's
        "use_cache": True,
    }


def transformers_weights(backbone, include_lm_head=False) -> dict:
    """Each block's attention or linear attention, norms, router, shared expert and experts
    (gate and up apart), by transformers' names."""
    from keras import ops
    weights = experts.outer_weights(backbone, include_lm_head)
    for i in range(backbone.num_layers):
        block, prefix = backbone.get_layer(f"transformer_layer_{i}"), f"model.layers.{i}"
        if block.layer_type == "full_attention":
            attention = block._self_attention_layer
            weights.update(experts.attention_weights(backbone, i, attention))
            weights[f"{prefix}.self_attn.q_norm.weight"] = attention._query_norm.scale
            weights[f"{prefix}.self_attn.k_norm.weight"] = attention._key_norm.scale
        else:
            weights.update(_linear_attention_weights(block._linear_attn, f"{prefix}.linear_attn"))
        weights[f"{prefix}.input_layernorm.weight"] = block._input_layernorm.scale
        weights[f"{prefix}.post_attention_layernorm.weight"] = block._post_attention_layernorm.scale
        moe, mlp = block.mlp, f"{prefix}.mlp"
        weights[f"{mlp}.gate.weight"] = ops.transpose(moe._router_gate.kernel)
        weights[f"{mlp}.shared_expert_gate.weight"] = ops.transpose(moe._shared_expert_gate.kernel)
        for name, dense in (("gate_proj", "_feedforward_gate_dense"), ("up_proj", "_feedforward_intermediate_dense"),
                            ("down_proj", "_feedforward_output_dense")):
            weights[f"{mlp}.shared_expert.{name}.weight"] = ops.transpose(getattr(moe.shared_expert, dense).kernel)
        weights.update(experts.fused_bank_weights(moe.expert_bank, mlp))
    return weights


def _linear_attention_weights(delta_net, prefix: str) -> dict:
    """A Gated DeltaNet's weights (keras-hub's Dense kernels (in, out); the causal
    convolution (channels, width), transformers' (channels, 1, width))."""
    from keras import ops
    weights = {f"{prefix}.{name}.weight": ops.transpose(getattr(delta_net, name).kernel)
               for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")}
    weights[f"{prefix}.conv1d.weight"] = ops.expand_dims(delta_net.conv1d_weight, axis=1)
    weights[f"{prefix}.dt_bias"] = delta_net.dt_bias
    weights[f"{prefix}.A_log"] = delta_net.A_log
    weights[f"{prefix}.norm.weight"] = delta_net.norm.scale
    return weights


FAMILY = register(Family(
    name="qwen3_5_moe",
    backbones=("Qwen3_5MoeBackbone",),
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    converter_model_types={"qwen3_5_moe_text": "qwen3_5_moe"},
    converter_prefixes={_COMPOSITE: _TEXT},
    read_config=read_config,
    layout=layout,
    ties=qwen3_5.TIES[:1] + qwen3_5.TIES[2:],
    lora_targets=qwen3_5.LORA_TARGETS[:4] + qwen3_5.LORA_TARGETS[7:],
    expert_targets=experts.fused_bank_targets("transformer_layer_{i}/sparse_moe_block"),
    attention=("Qwen3_5Attention",),
    fused_attention=("Qwen3_5Attention",),
    delta_nets=("Qwen3_5GatedDeltaNet",),
    transformers_config=transformers_config,
    transformers_weights=transformers_weights,
    transformers_tokenizer=qwen3.transformers_tokenizer,  # keras-hub 0.32 has none for its class
))
