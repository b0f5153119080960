"""Gemma 4 (keras-hub's Gemma4Backbone), its text model: transformers' `gemma4_text` and `gemma4`.

Gemma 3's blocks (sliding-window layers and global ones, query and key norms,
norms after attention and after the MLP, the head tied to the embedding), and
three things of its own:
- the global layers have heads of their own size (`global_head_dim`) and
  rotate a part of each head (proportional rotary positions); in the larger
  sizes they also have fewer key/value heads and reuse the key projection as
  the value (`attention_k_eq_v`);
- the small sizes (E2B, E4B) add per-layer token embeddings: a second
  embedding table (V x layers * P) and a projection of the hidden state, mixed
  into each block through a gate (`per_layer_input_gate`, D x P) and a
  projection back (`per_layer_up_proj`, P x D), which transformers and PEFT
  call `per_layer_input_gate` and `per_layer_projection`;
- later layers may reuse an earlier layer's keys and values
  (`num_kv_shared_layers`): they have no key and value kernels of their own.

transformers 5.24 writes the global layers' head size and key/value heads as
`per_layer_config` ({layer: {"head_dim": ...}}), which keras-hub 0.32's
converter does not read (it wants `global_head_dim`): `read_config` passes them
through. keras-hub's exporter leaves out the rotary types (transformers then
rotates the whole global head) and `attention_k_eq_v`: `transformers_config`
adds them. The vision and audio towers are not trained: a `gemma4` checkpoint
with either is refused, with the way to its text model; so is what keras-hub's
blocks hard-code.

The 26B-A4B's blocks add a mixture of experts beside the dense MLP (`enable_moe_block`):
keras-hub's router, with a learned scale per input feature, gives each token's weights
over the experts, and the bank (gate, up and output stacked, E first, and a learned
scale per expert's output) multiplies them. The jax engine computes the bank sparsely
from the router's weights (`models.moe`); there is no balancing loss (transformers has
none for Gemma 4). keras-hub's exporter writes the experts as transformers keeps them.
"""

# Imported inside functions: keras-hub (optional: absent on a plain install).
from tpu_keras.models.families import experts, gemma, gemma3
from tpu_keras.models.families.family import Family, Target, Unreadable, refuse_first, register
from tpu_keras.parallelism import Rule, replicated

LAYER = gemma3.LAYER
_BLOCK, _MODULE = "decoder_block_{i}", "model.layers.{i}"
_ROPE_TYPES = {"full_attention": "proportional", "sliding_attention": "default"}


def layout(config: dict) -> list[Rule]:
    """Gemma 3's rules, the per-layer embeddings' (P per-layer width, L layers): their
    table split over the vocabulary like the embedding, the rest small and whole; and the
    experts' where the blocks have them (`_expert_rules`)."""
    found = gemma3.layout(config) + (_expert_rules() if config.get("enable_moe_block") else [])
    if not config.get("hidden_size_per_layer_input"):  # the larger sizes have no per-layer embeddings
        return found
    return found + [
        # per_layer_token_embedding/embeddings                            (V, L * P)
        Rule(r"per_layer_token_embedding/embeddings", ("model", None)),
        # per_layer_model_projection/kernel                               (D, L * P)
        Rule(r"per_layer_model_projection/kernel", (None, "model")),
        # decoder_block_{i}/per_layer_input_gate/kernel (D, P); per_layer_up_proj/kernel (P, D)
        replicated(rf"{LAYER}/(per_layer_input_gate|per_layer_up_proj)/kernel"),
        # per_layer_projection_norm (P,); each block's post_per_layer_input_norm (D,) and
        # layer_scalar ()
        replicated(rf"(per_layer_projection_norm|{LAYER}/post_per_layer_input_norm)/scale"),
        replicated(rf"{LAYER}/layer_scalar"),
    ]


def _expert_rules() -> list[Rule]:
    """The 26B-A4B's blocks, a dense MLP (Gemma 3's rules) beside the experts (E experts, D
    hidden, F units each): the router's kernel (D, E) and its scale (D,) whole; gate and up
    (E, D, F) over `expert`, their units over `model`; the output (E, F, D) over `expert` and
    `model`; each expert's output scale (E,) and the two paths' norms (D,) whole."""
    bank = rf"{LAYER}/moe_expert_bank"
    return experts.rules(rf"{LAYER}/moe_router/(proj/kernel|per_dim_scale)",
                         [(rf"{bank}/(gate|up)_proj", ("expert", None, "model"))], rf"{bank}/down_proj") + [
        replicated(rf"{bank}/per_expert_scale"),
        replicated(rf"{LAYER}/(pre_ffw_norm_moe|post_ffw_norm_dense|post_ffw_norm_moe_path)/scale"),
    ]


LORA_TARGETS = gemma.LORA_TARGETS + (
    # per_layer_input_gate (D, P); per_layer_up_proj (P, D); per_layer_model_projection (D, L * P)
    Target("per_layer_input_gate", f"{_BLOCK}/per_layer_input_gate", f"{_MODULE}.per_layer_input_gate"),
    Target("per_layer_projection", f"{_BLOCK}/per_layer_up_proj", f"{_MODULE}.per_layer_projection"),
    Target("per_layer_model_projection", "per_layer_model_projection", "model.per_layer_model_projection"),
)


def read_config(config: dict) -> dict:
    if config.get("model_type") == "gemma4":
        raise Unreadable("a vision or audio tower (model_type 'gemma4'): the toolkit trains Gemma 4's "
                         "text model; save Gemma4ForConditionalGeneration's language model alone "
                         "(model_type 'gemma4_text') and point model.preset at it")
    kinds = config.get("layer_types") or []
    rope = config.get("rope_parameters") or {}
    rope_types = {kind: rope.get(kind, {}).get("rope_type", "default") for kind in _ROPE_TYPES}
    per_layer = {int(i): over for i, over in (config.get("per_layer_config") or {}).items()}
    full = {i for i, kind in enumerate(kinds) if kind == "full_attention"}
    overrides = {tuple(sorted(over.items())) for i, over in per_layer.items() if i in full}
    refuse_first([
        (not config.get("tie_word_embeddings", True), "an output head of its own (tie_word_embeddings "
         "false): Gemma4Backbone always ties it to the embedding"),
        (set(per_layer) - full, f"per_layer_config for sliding layers {sorted(set(per_layer) - full)}: "
         "Gemma4Backbone gives those of the global layers alone"),
        (len(overrides) > 1, "global layers of different head sizes (per_layer_config): "
         "Gemma4Backbone's are all alike"),
        (rope_types != _ROPE_TYPES, f"rope types {rope_types}: Gemma4Backbone's are "
         f"{_ROPE_TYPES}"),
        (config.get("use_bidirectional_attention") == "all", "bidirectional attention "
         "(use_bidirectional_attention 'all', an embedding model)"),
        (config.get("attention_bias"), "attention biases: Gemma4Backbone has none"),
        (config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
         f"hidden_activation {config.get('hidden_activation')!r}: Gemma4Backbone's MLP is "
         "gelu_pytorch_tanh's"),
    ])
    arguments = {}
    over = dict(next(iter(overrides), ()))
    if "head_dim" in over:
        arguments["global_head_dim"] = over["head_dim"]
    # keras-hub's global layers reuse the key projection as the value exactly where this is set,
    # and its converter sets it from a `num_global_key_value_heads` that transformers ignores
    # without `attention_k_eq_v`.
    arguments["num_global_key_value_heads"] = (
        over.get("num_key_value_heads", config.get("num_global_key_value_heads",
                                                   config["num_key_value_heads"]))
        if config.get("attention_k_eq_v") else None)
    return arguments


def transformers_config(backbone, include_lm_head=False) -> dict:
    """keras-hub's config.json with the rotary types and `attention_k_eq_v` it leaves out."""
    from keras_hub.src.utils.transformers.export.gemma4 import get_gemma4_config
    config = get_gemma4_config(backbone, include_lm_head=include_lm_head)
    for kind, rope_type in _ROPE_TYPES.items():
        config["rope_parameters"][kind]["rope_type"] = rope_type
    config["attention_k_eq_v"] = backbone.num_global_key_value_heads is not None
    if not config["attention_k_eq_v"]:  # keras-hub writes the key/value heads' count here
        config.pop("num_global_key_value_heads")
    config["architectures"] = ["Gemma4ForCausalLM"]
    return config


FAMILY = register(Family(
    name="gemma4",
    backbones=("Gemma4Backbone",),
    attention=("Gemma4TextAttention",),
    model_types=("gemma4_text", "gemma4"),
    read_config=read_config,
    layout=layout,
    ties=gemma3.TIES,
    lora_targets=LORA_TARGETS,
    transformers_config=transformers_config,
    fused_attention=("Gemma4TextAttention",),
))
