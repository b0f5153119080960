"""Gemma and Gemma 2 (keras-hub's GemmaBackbone): transformers' `gemma` and `gemma2`.

Its query, key and value kernels put the heads first, (heads, hidden,
head_dim), so their LoRA A reads axis 1. Layout: keras-hub's own
`get_layout_map`; with `fsdp` every large weight is split besides.
"""

# Imported inside functions: keras-hub (optional: absent on a plain install).
import keras
import numpy as np

from tpu_keras.models.families.family import Family, Target, Unreadable, no_rope_scaling, register


def read_config(config: dict) -> dict:
    """Gemma's attention has rope_theta 10000, fixed, and no rope scaling; its head is the
    embedding."""
    no_rope_scaling(config)
    if not config.get("tie_word_embeddings", True):
        raise Unreadable("an output head of its own (tie_word_embeddings false): GemmaBackbone "
                         "always ties it to the embedding")
    theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000))
    if theta != 10000:
        raise Unreadable(f"rope_theta {theta:g} (Gemma's attention has 10000 and no argument to "
                         "change it)")
    return {}


def transformers_weights(backbone, include_lm_head=False):
    """keras-hub 0.32's Gemma exporter with every key/value head: it writes the first alone
    (`key_dense.weights[0][0]`: right for Gemma 2B's one head, wrong for Gemma 7B's 16)."""
    from keras_hub.src.utils.transformers.export.gemma import get_gemma_weights_map
    weights = get_gemma_weights_map(backbone, include_lm_head=include_lm_head)
    for i in range(backbone.num_layers):
        attention = backbone.get_layer(f"decoder_block_{i}").attention
        for name, dense in (("q_proj", attention.query_dense), ("k_proj", attention.key_dense),
                            ("v_proj", attention.value_dense)):
            kernel = keras.ops.convert_to_numpy(dense.kernel)  # (heads, hidden, head_dim)
            weights[f"model.layers.{i}.self_attn.{name}.weight"] = np.ascontiguousarray(
                np.transpose(kernel, (0, 2, 1)).reshape(-1, kernel.shape[1]))
    return weights


_BLOCK, _MODULE = "decoder_block_{i}", "model.layers.{i}"
LORA_TARGETS = (
    # query (H, D, K), key and value (G, D, K): the input is axis 1
    Target("q_proj", f"{_BLOCK}/attention/query", f"{_MODULE}.self_attn.q_proj", inputs=(1,)),
    Target("k_proj", f"{_BLOCK}/attention/key", f"{_MODULE}.self_attn.k_proj", inputs=(1,)),
    Target("v_proj", f"{_BLOCK}/attention/value", f"{_MODULE}.self_attn.v_proj", inputs=(1,)),
    # attention_output (H, K, D)
    Target("o_proj", f"{_BLOCK}/attention/attention_output", f"{_MODULE}.self_attn.o_proj",
           inputs=(0, 1)),
    # ffw_gating, ffw_gating_2 (D, F); ffw_linear (F, D)
    Target("gate_proj", f"{_BLOCK}/ffw_gating", f"{_MODULE}.mlp.gate_proj"),
    Target("up_proj", f"{_BLOCK}/ffw_gating_2", f"{_MODULE}.mlp.up_proj"),
    Target("down_proj", f"{_BLOCK}/ffw_linear", f"{_MODULE}.mlp.down_proj"),
)

FAMILY = register(Family(
    name="gemma",
    backbones=("GemmaBackbone",),
    attention=("CachedGemmaAttention",),
    model_types=("gemma", "gemma2"),
    # keras-hub 0.32's converter leaves it out (Gemma's own 1e-6 is the backbone's default).
    converter_keys={"rms_norm_eps": "layer_norm_epsilon"},
    read_config=read_config,
    lora_targets=LORA_TARGETS,
    transformers_weights=transformers_weights,
))
