"""gpt-oss (keras-hub's GptOssBackbone): transformers' `gpt_oss`.

Attention with biases, a learned sink logit per head, and YaRN rotary
positions; every other block attends within a sliding window. A mixture of
experts in place of the MLP: a router with a bias whose top-k logits are
softmaxed, and fused experts (E x hidden x 2 units, gate and up interleaved,
with biases) under a clamped GLU. The jax engine computes the experts
sparsely (`models.moe`).

What keras-hub 0.32 gets wrong, and this file mends:
- Reading. Its converter reads only MXFP4 experts (the Hub's `_blocks` and
  `_scales`); transformers' save_pretrained of a fine-tuned or dequantized
  model writes float `gate_up_proj` and `down_proj`, read here as they are.
  It reads the YaRN factor from `rope_scaling`, which transformers 5 writes
  as `rope_parameters` (`read_config` passes it through).
- The sliding window. keras-hub puts it on the odd blocks and lets a query
  see `sliding_window` + 1 keys; transformers (the Hub's `layer_types`) on the
  even ones, `sliding_window` keys. `repair` sets each block's window as
  transformers does.
- No transformers exporter: the config and weights maps are the toolkit's.

The load-balancing loss: keras-hub's backbone takes no coefficient; the
toolkit applies transformers' `router_aux_loss_coef` of 0.9 (every released
size's), and refuses a checkpoint with another. No fused attention (the
TPU's splash kernel has no sink logit): gpt-oss attends through keras-hub's
own einsums. LoRA: PEFT's names on the attention projections, and PEFT's
`target_parameters` on the stacked experts (`EXPERT_TARGETS`, `models.expert_lora`).
"""

# Imported inside functions: keras-hub, NumPy's users (optional: absent on a plain install).
from tpu_keras.models.expert_lora import ExpertTarget
from tpu_keras.models.families import experts, llama
from tpu_keras.models.families.family import (Family, Unreadable, refuse_first, register,
                                              rope_parameters, rope_type)
from tpu_keras.parallelism import Rule, Tie, replicated

LAYER = llama.LAYER
ATTENTION = rf"{LAYER}/self_attention"
BLOCK = rf"{LAYER}/sparse_moe_block"
# transformers' GptOssConfig defaults, which every released size has and keras-hub hard-codes.
AUX_LOSS_COEFFICIENT = 0.9
_YARN = {"beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}
_GLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def layout(config: dict) -> list[Rule]:
    """Llama's rules for the attention kernels and the vocabulary; the attention's biases and
    sinks over `model` with their heads; and (E experts, H hidden, F units): the router
    (H, E) whole; gate and up, interleaved (E, H, 2F), over `expert`; the output (E, F, H)
    over `expert` and `model`; the experts' biases over `expert`."""
    dense = [rule for rule in experts.without_dense_mlp(llama.layout(config)) if "layernorm" not in rule.pattern]
    return dense + [
        Rule(rf"{ATTENTION}/(query|key|value)/bias", ("model", None)),    # (heads, K)
        replicated(rf"{ATTENTION}/attention_output/bias"),               # (H,)
        Rule(rf"{ATTENTION}/sinks", ("model",)),                          # (heads,)
        replicated(rf"({LAYER}/(input|post_attention)_layernorm|sequence_output_layernorm)/scale"),
        replicated(rf"{BLOCK}/router/router_dense/bias"),
    ] + experts.rules(
        rf"{BLOCK}/router/router_dense/kernel",
        [(rf"{BLOCK}/experts/gate_up_proj", ("expert", None, None))],
        rf"{BLOCK}/experts/down_proj",
        biases=[(rf"{BLOCK}/experts/(gate_up|down)_proj_bias", ("expert", None))])


TIES = (Tie("attention heads", ((rf"{ATTENTION}/(query|key|value)/kernel", 1),
                                (rf"{ATTENTION}/(query|key|value)/bias", 0),
                                (rf"{ATTENTION}/attention_output/kernel", 0),
                                (rf"{ATTENTION}/sinks", 0))),)


# PEFT's target_parameters: transformers keeps each block's experts as one parameter, (E, in,
# out) as keras-hub does: gate and up (E, H, 2F), the output (E, F, H).
EXPERT_TARGETS = tuple(
    ExpertTarget(f"mlp.experts.{name}", "transformer_layer_{i}/sparse_moe_block/experts",
                 "model.layers.{i}.mlp.experts", variable=name) for name in ("gate_up_proj", "down_proj"))


def read_config(config: dict) -> dict:
    """The YaRN factor transformers 5 writes under `rope_parameters`; refused: what keras-hub's
    backbone hard-codes otherwise (YaRN's other parameters, the GLU's, biases, alternating
    windows starting with a sliding one) and what `repair` cannot mend."""
    rope, kind = rope_parameters(config), rope_type(config)
    layers = config["num_hidden_layers"]
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    window = config.get("sliding_window")
    quantized = (config.get("quantization_config") or {}).get("quant_method")
    refuse_first([
        (kind not in ("yarn", "default"), f"rope_type {kind!r}: GptOssBackbone's rotary positions are YaRN's"),
        (kind == "yarn" and any(rope.get(key, value) != value for key, value in _YARN.items()),
         f"YaRN parameters {rope}: GptOssBackbone has {_YARN} alone"),
        (any(config.get(key, value) != value for key, value in _GLU.items()),
         f"swiglu_alpha {config.get('swiglu_alpha')}, swiglu_limit {config.get('swiglu_limit')}: "
         f"GptOssBackbone's GLU has {_GLU}"),
        (config.get("layer_types", alternating) != alternating,
         f"layer_types {config.get('layer_types')}: the toolkit reads gpt-oss's own, sliding and full "
         "attention in turn, starting with a sliding one"),
        (window is not None and window < 2, f"sliding_window {window}: keras-hub's mask needs 2 or more"),
        (not config.get("attention_bias", True), "attention_bias false: GptOssBackbone's attention has biases"),
        (config.get("tie_word_embeddings"), "tie_word_embeddings: GptOssBackbone's output head is its own"),
        (config.get("router_aux_loss_coef", AUX_LOSS_COEFFICIENT) != AUX_LOSS_COEFFICIENT,
         f"router_aux_loss_coef {config.get('router_aux_loss_coef')}: keras-hub's GptOssBackbone takes "
         f"no coefficient, and the toolkit applies transformers' {AUX_LOSS_COEFFICIENT}"),
        (quantized not in (None, "mxfp4"), f"quantization {quantized!r}: keras-hub reads MXFP4 experts "
         "or float ones"),
    ])
    return {"rope_scaling_factor": float(rope.get("factor", 1.0)) if kind == "yarn" else 1.0}


def repair(backbone) -> None:
    """Each block's sliding window as transformers applies it: on the even blocks, of
    `sliding_window` keys (keras-hub's mask keeps `window` + 1: it is given one less); the
    load-balancing loss's coefficient on each MoE block."""
    window = backbone.sliding_window
    for i, block in enumerate(backbone.transformer_layers):
        block.self_attention_layer.sliding_window = window - 1 if window and i % 2 == 0 else None
        block.sparse_moe_block.router_aux_loss_coefficient = AUX_LOSS_COEFFICIENT  # `models.moe` reads it


def convert_weights(backbone, weights, config: dict) -> None:
    """A checkpoint's weights: MXFP4 experts by keras-hub's converter, float ones (what
    transformers' save_pretrained writes of a float model) as they are."""
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        from keras_hub.src.utils.transformers import convert_gpt_oss
        convert_gpt_oss.convert_weights(backbone, weights, config)
        return
    import numpy as np

    def heads(tensor, shape):  # transformers' (out, in) to Keras's kernel, heads a dimension apart
        return np.reshape(np.transpose(tensor), shape)

    port = weights.port_weight
    port(backbone.token_embedding.embeddings, "model.embed_tokens.weight")
    port(backbone.token_embedding.reverse_embeddings, "lm_head.weight", lambda tensor, _: np.transpose(tensor))
    for i, block in enumerate(backbone.transformer_layers):
        prefix, attention = f"model.layers.{i}", block.self_attention_layer
        for name, dense in _projections(attention):
            port(dense.kernel, f"{prefix}.self_attn.{name}.weight", heads)
            port(dense.bias, f"{prefix}.self_attn.{name}.bias", lambda tensor, shape: np.reshape(tensor, shape))
        port(attention.sinks, f"{prefix}.self_attn.sinks")
        moe = block.sparse_moe_block
        port(moe.router.router_dense.kernel, f"{prefix}.mlp.router.weight", lambda tensor, _: np.transpose(tensor))
        port(moe.router.router_dense.bias, f"{prefix}.mlp.router.bias")
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):  # Keras's shapes
            port(getattr(moe.experts, name), f"{prefix}.mlp.experts.{name}")
        port(block.input_layernorm.scale, f"{prefix}.input_layernorm.weight")
        port(block.post_attention_layernorm.scale, f"{prefix}.post_attention_layernorm.weight")
    port(backbone.layer_norm.scale, "model.norm.weight")


def _projections(attention) -> tuple:
    return (("q_proj", attention.query_dense), ("k_proj", attention.key_dense),
            ("v_proj", attention.value_dense), ("o_proj", attention.output_dense))


def transformers_config(backbone) -> dict:
    """GptOssForCausalLM's config.json, in transformers 5's keys; a run from a checkpoint
    keeps the checkpoint's own keys over these (`export`)."""
    from keras_hub.src.models.gpt_oss.gpt_oss_tokenizer import GptOssTokenizer
    if not hasattr(GptOssTokenizer, "start_token"):  # keras-hub 0.32's exporter reads it next; the
        GptOssTokenizer.start_token = None           # class has none (gpt-oss has no start token)
    factor = backbone.rope_scaling_factor
    rope = ({"rope_type": "yarn", "factor": factor, **_YARN} if factor != 1.0 else {"rope_type": "default"})
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": backbone.vocabulary_size, "hidden_size": backbone.hidden_dim,
        "intermediate_size": backbone.intermediate_dim, "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_query_heads, "num_key_value_heads": backbone.num_key_value_heads,
        "head_dim": backbone.head_dim or backbone.hidden_dim // backbone.num_query_heads,
        "num_local_experts": backbone.num_experts, "num_experts_per_tok": backbone.top_k,
        "router_aux_loss_coef": AUX_LOSS_COEFFICIENT, "output_router_logits": False,
        "sliding_window": backbone.sliding_window,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(backbone.num_layers)],
        "rms_norm_eps": backbone.layer_norm_epsilon, "hidden_act": "silu", **_GLU,
        "rope_parameters": {**rope, "rope_theta": backbone.rope_max_wavelength},
        "attention_bias": True, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "max_position_embeddings": 131072,  # gpt-oss's; a run from a checkpoint keeps the checkpoint's
        "use_cache": True,
    }


def transformers_weights(backbone, include_lm_head=False) -> dict:
    """Every weight by transformers' name, the experts fused as transformers keeps them
    (float: the export is a fine-tuned model, not MXFP4)."""
    from keras import ops
    weights = experts.outer_weights(backbone, include_lm_head)  # its head is never tied
    for i, block in enumerate(backbone.transformer_layers):
        prefix, attention = f"model.layers.{i}", block.self_attention_layer
        weights.update(experts.attention_weights(backbone, i, attention, (
            "query_dense", "key_dense", "value_dense", "output_dense")))
        for name, dense in _projections(attention):
            weights[f"{prefix}.self_attn.{name}.bias"] = ops.reshape(dense.bias, (-1,))
        weights[f"{prefix}.self_attn.sinks"] = attention.sinks
        moe = block.sparse_moe_block
        weights[f"{prefix}.mlp.router.weight"] = ops.transpose(moe.router.router_dense.kernel)
        weights[f"{prefix}.mlp.router.bias"] = moe.router.router_dense.bias
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            weights[f"{prefix}.mlp.experts.{name}"] = getattr(moe.experts, name)
        weights[f"{prefix}.input_layernorm.weight"] = block.input_layernorm.scale
        weights[f"{prefix}.post_attention_layernorm.weight"] = block.post_attention_layernorm.scale
    return weights


def transformers_tokenizer(tokenizer) -> dict:
    """tokenizer_config.json of gpt-oss's byte-pair tokenizer (o200k_harmony's tokenizer.json)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
            "eos_token": tokenizer.end_token, "pad_token": tokenizer.id_to_token(tokenizer.pad_token_id),
            "model_max_length": 131072}


FAMILY = register(Family(
    name="gpt_oss",
    backbones=("GptOssBackbone",),
    attention=("GptOssAttention",),
    model_types=("gpt_oss",),
    read_config=read_config,
    repair=repair,
    convert_weights=convert_weights,
    layout=layout,
    ties=TIES,
    lora_targets=llama.LORA_TARGETS[:4],
    expert_targets=EXPERT_TARGETS,
    transformers_config=transformers_config,
    transformers_weights=transformers_weights,
    transformers_tokenizer=transformers_tokenizer,
))
