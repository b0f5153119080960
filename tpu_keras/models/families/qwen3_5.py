"""Qwen 3.5, dense (keras-hub's Qwen3_5Backbone), its text model: transformers' `qwen3_5_text`.

A hybrid: three of every four blocks are Gated DeltaNet linear attention
(`linear_attn`: a projection of queries, keys and values through a causal
depthwise convolution, a recurrent state decayed and written token by token,
a gated RMS norm), the fourth full attention with an output gate (the query
projection gives each head its query and its gate) and a quarter of each head
rotated. Its RMS norms scale by 1 + weight, as Gemma's.

Reading. keras-hub 0.32's loader knows the model only by its composite
`model_type`, `qwen3_5` (the text model under `text_config`, weights under
`model.language_model.`), which transformers writes for the model with its
vision tower; a text model that transformers' `Qwen3_5ForCausalLM` writes is
`qwen3_5_text`, its weights under `model.`. `converter_model_types` and
`converter_prefixes` let keras-hub's converter read it. The vision tower is
not trained: a `qwen3_5` checkpoint with one is refused, with the way to the
text model. keras-hub's attention applies a sliding window of 32,768 tokens
that transformers' has not, and only where Keras has no fused attention (the
tf engine): `read_config` turns it off.

Packing: the full attention layers keep to one example as every family's do;
the DeltaNet's state and convolution restart at each example's first token
(`gated_delta_net`). LoRA: PEFT's names, the linear attention's five
projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
`out_proj`) among them; PEFT has no default targets for `qwen3_5_text`, ours
are `q_proj`, `v_proj` (full attention layers alone have them). Export:
keras-hub's exporter writes the composite model; the toolkit writes the text
model `Qwen3_5ForCausalLM` reads (its config, the same weights under `model.`).
"""

# Imported inside functions: keras-hub (optional: absent on a plain install).
from tpu_keras.models.families import llama
from tpu_keras.models.families.family import (Family, Target, Unreadable, refuse_first, register,
                                              rope_parameters, unbuilt_llama_parts)
from tpu_keras.parallelism import Rule, Tie, replicated

LAYER = llama.LAYER
_BLOCK, _MODULE = "transformer_layer_{i}", "model.layers.{i}"
_COMPOSITE, _TEXT = "model.language_model.", "model."


def layout(config: dict) -> list[Rule]:
    """Heads, MLP units and the linear attention's channels over `model`, the vocabulary too
    (V vocabulary, D hidden, H query heads, G key/value heads, K head size, F MLP units; C the
    linear attention's query, key and value channels, Z its value channels, N its value heads).
    The linear attention splits its channels in blocks across its queries, keys and values:
    the compiler moves them to their heads, right, at the cost of an exchange per layer."""
    rules = [
        # token_embedding/embeddings                                        (V, D)
        Rule(r"token_embedding/embeddings", ("model", None)),
        # transformer_layer_{i}/self_attention/query/kernel: query and gate (D, H, 2K);
        # key, value (D, G, K); attention_output (H, K, D)
        Rule(rf"{LAYER}/self_attention/(query|key|value)/kernel", (None, "model", None)),
        Rule(rf"{LAYER}/self_attention/attention_output/kernel", ("model", None, None)),
        # transformer_layer_{i}/linear_attn/in_proj_qkv/kernel (D, C); conv1d_kernel (C, 4);
        # in_proj_z/kernel (D, Z); out_proj/kernel (Z, D)
        Rule(rf"{LAYER}/linear_attn/(in_proj_qkv|in_proj_z)/kernel", (None, "model")),
        Rule(rf"{LAYER}/linear_attn/conv1d_kernel", ("model", None)),
        Rule(rf"{LAYER}/linear_attn/out_proj/kernel", ("model", None)),
        # in_proj_b, in_proj_a (D, N); dt_bias, A_log (N,); norm/scale (its head size): small
        replicated(rf"{LAYER}/linear_attn/(in_proj_b|in_proj_a)/kernel"),
        replicated(rf"{LAYER}/linear_attn/(dt_bias|A_log|norm/scale)"),
        # transformer_layer_{i}/feedforward_{gate,intermediate}_dense/kernel (D, F); output (F, D)
        Rule(rf"{LAYER}/feedforward_(intermediate|gate)_dense/kernel", (None, "model")),
        Rule(rf"{LAYER}/feedforward_output_dense/kernel", ("model", None)),
        # the blocks' norms (D,), the query and key norms (K,), the final norm (D,)
        replicated(rf"({LAYER}/(input_layernorm|post_attention_layernorm|self_attention/(query|key)_norm)"
                   r"|sequence_output_layernorm)/scale"),
    ]
    if not config.get("tie_word_embeddings", False):
        # token_embedding/reverse_embeddings: the untied output head        (D, V)
        rules.append(Rule(r"token_embedding/reverse_embeddings", (None, "model")))
    return rules


TIES = llama.TIES + (
    Tie("linear attention channels", ((rf"{LAYER}/linear_attn/in_proj_qkv/kernel", 1),
                                      (rf"{LAYER}/linear_attn/conv1d_kernel", 0))),
    Tie("linear attention values", ((rf"{LAYER}/linear_attn/in_proj_z/kernel", 1),
                                    (rf"{LAYER}/linear_attn/out_proj/kernel", 0))),
)

# PEFT's module names: Llama's in the full attention layers and every MLP; the linear
# attention's five projections, all Dense (D, out) but out_proj (Z, D).
LORA_TARGETS = llama.LORA_TARGETS + tuple(
    Target(name, f"{_BLOCK}/linear_attn/{name}", f"{_MODULE}.linear_attn.{name}")
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"))


def read_config(config: dict) -> dict:
    if config.get("model_type") == "qwen3_5" and config.get("vision_config"):
        raise Unreadable("a vision tower (model_type 'qwen3_5'): the toolkit trains Qwen 3.5's text "
                         "model; save Qwen3_5ForConditionalGeneration's language model alone "
                         "(model_type 'qwen3_5_text') and point model.preset at it")
    text = config.get("text_config") or config
    rope = rope_parameters(text)
    kind = rope.get("rope_type", "default")
    kinds = set(text.get("layer_types") or ())
    refuse_first([
        (kind != "default", f"rope_type {kind!r}, which its converter does not read"),
        (kinds - {"linear_attention", "full_attention"},
         f"layer_types {sorted(kinds)}: Qwen3_5Backbone has linear and full attention layers alone"),
        (text.get("attn_output_gate") is False, "attn_output_gate false: Qwen3_5Backbone's attention "
         "always gates its output"),
        (text.get("mlp_only_layers") or text.get("num_experts"), "experts (mlp_only_layers, "
         "num_experts): the dense Qwen3_5Backbone has none"),
        *unbuilt_llama_parts(config=text, backbone="Qwen3_5Backbone"),
    ])
    return {"sliding_window_size": None}


def transformers_config(backbone) -> dict:
    """keras-hub's text config, as the text model's own config.json."""
    from keras_hub.src.utils.transformers.export.qwen3_5 import get_qwen3_5_config
    config = dict(get_qwen3_5_config(backbone)["text_config"])
    for key in ("eos_token_id", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",
                "full_attention_interval", "mlp_only_layers"):  # keras-hub's, Qwen 3.5's release
        config.pop(key, None)
    return {**config, "architectures": ["Qwen3_5ForCausalLM"]}


def transformers_weights(backbone, include_lm_head=False) -> dict:
    """keras-hub's weights map, under the text model's names."""
    from keras_hub.src.utils.transformers.export.qwen3_5 import get_qwen3_5_weights_map
    weights = get_qwen3_5_weights_map(backbone, include_lm_head=include_lm_head)
    return {_TEXT + name[len(_COMPOSITE):] if name.startswith(_COMPOSITE) else name: tensor
            for name, tensor in weights.items()}


FAMILY = register(Family(
    name="qwen3_5",
    backbones=("Qwen3_5Backbone",),
    model_types=("qwen3_5", "qwen3_5_text"),
    converter_model_types={"qwen3_5_text": "qwen3_5"},
    converter_prefixes={_COMPOSITE: _TEXT},
    read_config=read_config,
    layout=layout,
    ties=TIES,
    lora_targets=LORA_TARGETS,
    attention=("Qwen3_5Attention",),
    fused_attention=("Qwen3_5Attention",),
    delta_nets=("Qwen3_5GatedDeltaNet",),
    transformers_config=transformers_config,
    transformers_weights=transformers_weights,
))
