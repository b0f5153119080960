"""Gemma 3 (keras-hub's Gemma3Backbone), its text model: transformers' `gemma3_text` and `gemma3`.

Five sliding-window layers to one global layer, each with an RMS norm of its
query and key heads, norms after attention and after the MLP, and the head
tied to the embedding. Its query, key and value kernels put the heads first,
(heads, hidden, head_dim), as Gemma's do, so it takes Gemma's LoRA targets
(the same paths and PEFT modules). The sliding window is applied inside the
attention's `_compute_attention`, to the mask the toolkit has already kept to
one example, so packed examples stay apart in both kinds of layer. The
TPU's fused kernel serves both kinds: a static window in place of keras-hub's
(`splash_attention`'s adapter for the class).

keras-hub 0.32's backbone fixes what transformers' config can change, and
`read_config` refuses a checkpoint that changes it: the rope wavelengths
(1e6 global, 1e4 local), the pattern of sliding layers (every sixth global),
the query scale (1 / sqrt(head_dim): the block ignores
`query_pre_attn_scalar`), the activation (tanh-approximated gelu), an untied
head, biases, and attention logit soft-capping (which transformers 5.24 does
not apply and keras-hub does). A `gemma3` checkpoint's vision tower is not
trained: such a checkpoint is refused, with the way to the text model.
"""

from tpu_keras.models.families import gemma
from tpu_keras.models.families.family import Family, Unreadable, refuse_first, register
from tpu_keras.parallelism import Rule, Tie, replicated

LAYER = r"decoder_block_\d+"
_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0


def layout(config: dict) -> list[Rule]:
    """Heads and MLP units over `model`, the vocabulary too (H query heads, G key/value
    heads, K head size, D hidden, F MLP units, V vocabulary)."""
    del config  # always tied
    return [
        # token_embedding/embeddings, also the output head                  (V, D)
        Rule(r"token_embedding/embeddings", ("model", None)),
        # decoder_block_{i}/attention/query/kernel (H, D, K); key, value (G, D, K);
        # attention_output (H, K, D)
        Rule(rf"{LAYER}/attention/(query|key|value|attention_output)/kernel", ("model", None, None)),
        # decoder_block_{i}/ffw_gating{,_2}/kernel                           (D, F)
        Rule(rf"{LAYER}/ffw_gating(_2)?/kernel", (None, "model")),
        # decoder_block_{i}/ffw_linear/kernel                                (F, D)
        Rule(rf"{LAYER}/ffw_linear/kernel", ("model", None)),
        # the block's norms (D,), the query and key norms (K,), the final norm (D,)
        replicated(rf"({LAYER}/(pre|post)_(attention|ffw)_norm|{LAYER}/attention/(query|key)_norm"
                   r"|final_normalization)/scale"),
    ]


TIES = (
    Tie("attention heads", ((rf"{LAYER}/attention/(query|key|value|attention_output)/kernel", 0),)),
    Tie("MLP units", ((rf"{LAYER}/ffw_gating(_2)?/kernel", 1), (rf"{LAYER}/ffw_linear/kernel", 0))),
)


def read_config(config: dict) -> dict:
    if config.get("model_type") == "gemma3":
        raise Unreadable("a vision tower (model_type 'gemma3'): the toolkit trains Gemma 3's text "
                         "model; save Gemma3ForConditionalGeneration's language model alone "
                         "(model_type 'gemma3_text') and point model.preset at it")
    layers = config["num_hidden_layers"]
    pattern = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    rope = config.get("rope_parameters") or {}
    thetas = {"full_attention": rope.get("full_attention", {}).get("rope_theta",
                                                                   config.get("rope_theta", _GLOBAL_THETA)),
              "sliding_attention": rope.get("sliding_attention", {}).get(
                  "rope_theta", config.get("rope_local_base_freq", _LOCAL_THETA))}
    kinds = {rope.get(kind, {}).get("rope_type", "default") for kind in thetas}
    head_dim = config.get("head_dim")
    refuse_first([
        (not config.get("tie_word_embeddings", True), "an output head of its own (tie_word_embeddings "
         "false): Gemma3Backbone always ties it to the embedding"),
        (config.get("layer_types") not in (None, pattern), f"layer_types {config.get('layer_types')}: "
         "Gemma3Backbone makes every sixth layer global, the others sliding"),
        (thetas != {"full_attention": _GLOBAL_THETA, "sliding_attention": _LOCAL_THETA},
         f"rope_theta {thetas}: Gemma3Backbone's are 1e6 (global) and 1e4 (sliding)"),
        (not kinds <= {"default", "linear"}, f"rope_type {sorted(kinds)}: Gemma3Backbone scales "
         "its rotary positions linearly alone"),
        (config.get("query_pre_attn_scalar", head_dim) != head_dim,
         f"query_pre_attn_scalar {config.get('query_pre_attn_scalar')} other than head_dim "
         f"{head_dim}: Gemma3Backbone's blocks scale queries by head_dim"),
        (config.get("attn_logit_softcapping") is not None, "attn_logit_softcapping: transformers "
         "5.24's Gemma 3 does not apply it and keras-hub's does"),
        (config.get("attention_bias"), "attention biases: Gemma3Backbone has none"),
        (config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
         f"hidden_activation {config.get('hidden_activation')!r}: Gemma3Backbone's MLP is "
         "gelu_pytorch_tanh's"),
    ])
    return {}


FAMILY = register(Family(
    name="gemma3",
    backbones=("Gemma3Backbone",),
    attention=("CachedGemma3Attention",),
    fused_attention=("CachedGemma3Attention",),
    model_types=("gemma3_text", "gemma3"),
    read_config=read_config,
    layout=layout,
    ties=TIES,
    lora_targets=gemma.LORA_TARGETS,
))
