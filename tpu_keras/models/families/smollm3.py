"""SmolLM3 (keras-hub's SmolLM3Backbone): transformers' `smollm3`.

Llama's computation with rotary positions left out of some layers (NoPE:
every fourth of SmolLM3-3B's; keras-hub reads `no_rope_layers`). Its
projections are plain `Dense` layers named as transformers names them
(`self_attn/q_proj`, `mlp/gate_proj`, ...), the query, key and value of
shape (hidden, heads x head_dim), and the attention output an `EinsumDense`
(heads, head_dim, hidden).

keras-hub 0.32 gets three things wrong that the toolkit mends or refuses:
- each layer's attention output and rotary table are built outside their
  block, so every layer's weight has one path, `o_proj/kernel`: `repair`
  gives them their block's (layout rules, LoRA and checkpoints key by path);
- the backbone always ties its head to the embedding, has no head size of
  its own (hidden / heads), builds biases it never loads, and has no sliding
  window: a checkpoint that asks for any of them is refused (`read_config`);
- it has no transformers exporter: `transformers_config` and
  `transformers_weights` below are the toolkit's.
"""

import keras

from tpu_keras.models.families.family import Family, Target, no_rope_scaling, refuse_first, register
from tpu_keras.parallelism import Rule, Tie, replicated

LAYER = r"transformer_layer_\d+"
# The attention output and rotary table: placed as they are made, under keras-hub's path
# ('o_proj/kernel'), and found under the block's once `repair` ran.
BUILT_OUTSIDE = rf"({LAYER}/self_attn/)?"


def layout(config: dict) -> list[Rule]:
    """Megatron-style, as Llama's: heads and MLP units over `model`, the vocabulary too."""
    del config  # always tied
    return [
        # token_embedding/embeddings, also the output head                   (V, D)
        Rule(r"token_embedding/embeddings", ("model", None)),
        # transformer_layer_{i}/self_attn/{q,k,v}_proj/kernel                (D, heads x K)
        Rule(rf"{LAYER}/self_attn/(q|k|v)_proj/kernel", (None, "model")),
        # transformer_layer_{i}/self_attn/o_proj/kernel                      (H, K, D)
        Rule(rf"{BUILT_OUTSIDE}o_proj/kernel", ("model", None, None)),
        # transformer_layer_{i}/mlp/{gate,up}_proj/kernel                    (D, F)
        Rule(rf"{LAYER}/mlp/(gate|up)_proj/kernel", (None, "model")),
        # transformer_layer_{i}/mlp/down_proj/kernel                         (F, D)
        Rule(rf"{LAYER}/mlp/down_proj/kernel", ("model", None)),
        # transformer_layer_{i}/{input,post_attention}_layernorm/scale,
        # sequence_output_layernorm/scale                                    (D,)
        replicated(rf"({LAYER}/(input|post_attention)_layernorm|sequence_output_layernorm)/scale"),
        # transformer_layer_{i}/self_attn/rotary_emb/inv_freq: the rotary table (K / 2,)
        replicated(rf"{BUILT_OUTSIDE}rotary_emb/inv_freq"),
    ]


TIES = (
    Tie("attention heads", ((rf"{LAYER}/self_attn/(q|k|v)_proj/kernel", 1),
                            (rf"{BUILT_OUTSIDE}o_proj/kernel", 0))),
    Tie("MLP units", ((rf"{LAYER}/mlp/(gate|up)_proj/kernel", 1), (rf"{LAYER}/mlp/down_proj/kernel", 0))),
)

_BLOCK, _MODULE = "transformer_layer_{i}", "model.layers.{i}"
LORA_TARGETS = tuple(
    Target(name, f"{_BLOCK}/{part}/{name}", f"{_MODULE}.{part}.{name}",
           inputs=(0, 1) if name == "o_proj" else (0,))
    for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                        ("mlp", ("gate_proj", "up_proj", "down_proj")))
    for name in names)


def repair(backbone) -> None:
    """Gives each block's attention output and rotary table the block's path, as keras-hub
    0.32 gives its other weights (it builds them outside the block: 'o_proj/kernel' in every
    layer). Before anything keys the weights by path."""
    for i, block in enumerate(backbone.transformer_layers):
        prefix = f"transformer_layer_{i}/self_attn/"
        for layer in (block.self_attn.o_proj, block.self_attn.rotary_embedding):
            if layer.path and not layer.path.startswith(prefix):
                layer._path = prefix + layer.path
            layer._parent_path = prefix[:-1]  # where weights added later (LoRA's) are named
            for variable in layer.variables:
                if not variable.path.startswith(prefix):
                    variable._path = prefix + variable.path


def read_config(config: dict) -> dict:
    no_rope_scaling(config)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    refuse_first([
        (not config.get("tie_word_embeddings", True), "an output head of its own "
         "(tie_word_embeddings false): SmolLM3Backbone always ties it to the embedding"),
        (config.get("head_dim", hidden // heads) != hidden // heads,
         f"head_dim {config.get('head_dim')}: SmolLM3Backbone's is hidden_size / num_attention_heads"),
        (config.get("attention_bias") or config.get("mlp_bias"),
         "biases (attention_bias or mlp_bias): keras-hub's converter loads none"),
        (config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or ()),
         "a sliding window: SmolLM3Backbone has none"),
        (config.get("hidden_act", "silu") != "silu",
         f"hidden_act {config.get('hidden_act')!r}: SmolLM3Backbone's MLP is silu's"),
    ])
    return {}


def transformers_config(backbone) -> dict:
    return {
        "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3",
        "vocab_size": backbone.vocabulary_size, "hidden_size": backbone.hidden_dim,
        "intermediate_size": backbone.intermediate_dim, "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_attention_heads,
        "num_key_value_heads": backbone.num_key_value_heads, "hidden_act": "silu",
        "rms_norm_eps": backbone.layer_norm_epsilon, "rope_theta": backbone.rope_theta,
        "max_position_embeddings": backbone.max_position_embeddings,
        "no_rope_layers": [int(bool(x)) for x in backbone.rope_layer_enabled_list],
        "layer_types": list(backbone.layer_types), "use_sliding_window": False,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
        "attention_dropout": backbone.attention_dropout, "use_cache": True,
        # SmolLM3Config's default, 128004, is past a smaller vocabulary, which transformers
        # refuses; the exporter adds the tokenizer's start and end ids, a run from a checkpoint
        # keeps the checkpoint's.
        "pad_token_id": None,
    }


def transformers_weights(backbone, include_lm_head=False) -> dict:
    """{transformers name: tensor}: Dense kernels transposed, the attention output flattened."""
    ops = keras.ops
    weights = {"model.embed_tokens.weight": backbone.get_layer("token_embedding").embeddings,
               "model.norm.weight": backbone.get_layer("sequence_output_layernorm").scale}
    for i, block in enumerate(backbone.transformer_layers):
        module = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            kernel = getattr(block.self_attn, name).kernel  # (D, heads x K)
            weights[f"{module}.self_attn.{name}.weight"] = ops.transpose(kernel)
        output = block.self_attn.o_proj.kernel  # (H, K, D)
        weights[f"{module}.self_attn.o_proj.weight"] = ops.transpose(
            ops.reshape(output, (-1, output.shape[-1])))
        for name in ("gate_proj", "up_proj", "down_proj"):
            weights[f"{module}.mlp.{name}.weight"] = ops.transpose(getattr(block.mlp, name).kernel)
        weights[f"{module}.input_layernorm.weight"] = block.input_layernorm.scale
        weights[f"{module}.post_attention_layernorm.weight"] = block.post_attention_layernorm.scale
    del include_lm_head  # tied: transformers reads the head from the embedding
    return weights


def transformers_tokenizer(tokenizer) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.start_token,
            "eos_token": tokenizer.end_token, "pad_token": tokenizer.end_token,
            "model_max_length": 65536}


FAMILY = register(Family(
    name="smollm3",
    backbones=("SmolLM3Backbone",),
    attention=("SmolLM3Attention",),
    model_types=("smollm3",),
    read_config=read_config,
    repair=repair,
    layout=layout,
    ties=TIES,
    lora_targets=LORA_TARGETS,
    fused_attention=("SmolLM3Attention",),
    transformers_config=transformers_config,
    transformers_weights=transformers_weights,
    transformers_tokenizer=transformers_tokenizer,
))
