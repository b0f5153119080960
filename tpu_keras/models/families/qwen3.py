"""Qwen 3 (keras-hub's Qwen3Backbone): transformers' `qwen3`.

Llama's weights with the same paths, plus an RMS norm of each query and key
head (`query_dense_layernorm`, `key_dense_layernorm`, of head_dim: small, on
every device), a head size of its own (`head_dim`, 128 in every released
size, not hidden / heads) and no biases. So it takes Llama's layout rules,
ties and LoRA targets (PEFT's names and modules are Llama's too). The norms
come before `_compute_attention`, which gets keys and values repeated to the
query's heads, as Llama's: the TPU's fused kernel serves it.

keras-hub 0.32 reads it but has no transformers exporter for it: the config
and weights maps below are the toolkit's, Llama 3's map and the two norms.
keras-hub's converter reads no rope scaling, and its sliding window (the
backbone's `sliding_window_size`) covers every layer where transformers'
covers those of `layer_types`, and is left out of the fused attention the jax
engine takes: a checkpoint with either is refused.
"""

# Imported inside functions: keras-hub (optional: absent on a plain install).
from tpu_keras.models.families import llama
from tpu_keras.models.families.family import (Family, no_rope_scaling, refuse_first, register,
                                              unbuilt_llama_parts)
from tpu_keras.parallelism import replicated


def layout(config: dict):
    # transformer_layer_{i}/self_attention/{query,key}_dense_layernorm/scale    (K,)
    return llama.layout(config) + [
        replicated(rf"{llama.LAYER}/self_attention/(query|key)_dense_layernorm/scale")]


def read_config(config: dict) -> dict:
    no_rope_scaling(config)
    kinds = set(config.get("layer_types") or ())
    windowed = bool(config.get("use_sliding_window"))
    refuse_first([
        (windowed and kinds != {"sliding_attention"}, f"a sliding window on some layers alone "
         f"(layer_types {sorted(kinds)}, max_window_layers {config.get('max_window_layers')}); "
         "Qwen3Backbone's window covers every layer"),
        # keras-hub 0.32's Qwen3Attention applies its window only where Keras has no fused
        # attention, and on jax (a CPU too) it always has: 4.25 off transformers' logits.
        (windowed, "a sliding window, which keras-hub 0.32's Qwen3Attention leaves out of its fused "
         "attention (the jax engine's)"),
        *unbuilt_llama_parts(config, "Qwen3Backbone"),
    ])
    return {}


def transformers_config(backbone) -> dict:
    window = backbone.sliding_window_size
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": backbone.vocabulary_size, "hidden_size": backbone.hidden_dim,
        "intermediate_size": backbone.intermediate_dim, "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_query_heads,
        "num_key_value_heads": backbone.num_key_value_heads, "head_dim": backbone.head_dim,
        "hidden_act": "silu", "rms_norm_eps": backbone.layer_norm_epsilon,
        "rope_theta": backbone.rope_max_wavelength, "attention_bias": False,
        "attention_dropout": backbone.dropout, "tie_word_embeddings": backbone.tie_word_embeddings,
        "use_sliding_window": bool(window), "sliding_window": window,
        "max_window_layers": 0 if window else backbone.num_layers,
        "max_position_embeddings": 40960,  # Qwen 3's; a run from a checkpoint keeps the checkpoint's
        "use_cache": True,
    }


def transformers_weights(backbone, include_lm_head=False) -> dict:
    """Llama 3's weights map (the same layers) and each block's query and key norms."""
    from keras_hub.src.utils.transformers.export.llama3 import get_llama3_weights_map
    weights = get_llama3_weights_map(backbone, include_lm_head=include_lm_head)
    for i in range(backbone.num_layers):
        attention = backbone.get_layer(f"transformer_layer_{i}")._self_attention_layer
        weights[f"model.layers.{i}.self_attn.q_norm.weight"] = attention._query_dense_layer_norm.scale
        weights[f"model.layers.{i}.self_attn.k_norm.weight"] = attention._key_dense_layer_norm.scale
    return weights


def transformers_tokenizer(tokenizer) -> dict:
    """tokenizer_config.json of a Qwen 3 tokenizer: Qwen 2's byte-pair class, no start token."""
    return {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": tokenizer.end_token,
            "pad_token": tokenizer.pad_token, "unk_token": None, "model_max_length": 40960}


FAMILY = register(Family(
    name="qwen3",
    backbones=("Qwen3Backbone",),
    attention=("Qwen3Attention",),
    fused_attention=("Qwen3Attention",),
    model_types=("qwen3",),
    read_config=read_config,
    layout=layout,
    ties=llama.TIES,
    lora_targets=llama.LORA_TARGETS,
    transformers_config=transformers_config,
    transformers_weights=transformers_weights,
    transformers_tokenizer=transformers_tokenizer,
))
