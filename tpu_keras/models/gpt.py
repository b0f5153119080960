"""`gpt`: a decoder-only transformer language model (pre-norm, learned positions).

Layers are named per block (`block0_attention`, `block0_mlp_up`, ...) so that
weight paths are stable and readable for layout rules and checkpoints. Its
projections take LoRA under PEFT's names (`LORA_TARGETS`, `models.lora`).
"""

import keras
from keras import layers

from tpu_keras.parallelism import Rule, replicated
from tpu_keras.models import lora, segments
from tpu_keras.models.metrics import bits_per_byte, token_mean_loss
from tpu_keras.models.registry import register

# PEFT's names for the gpt's projections (it has no gate): query, key and value kernels
# (W, H, K) read W, the attention output (H, K, W) reads H x K, the MLP's are Dense.
LORA_TARGETS = (
    lora.Target("q_proj", "block{i}_attention/query"),
    lora.Target("k_proj", "block{i}_attention/key"),
    lora.Target("v_proj", "block{i}_attention/value"),
    lora.Target("o_proj", "block{i}_attention/attention_output", inputs=(0, 1)),
    lora.Target("up_proj", "block{i}_mlp_up"),
    lora.Target("down_proj", "block{i}_mlp_down"),
)
LORA_DEFAULT = ("q_proj", "v_proj")  # PEFT's for GPT-style models too


class PositionEmbedding(layers.Layer):
    """Adds a learned vector per position to a (batch, length, width) input; given each
    token's position (examples packed apart: each restarts at 0), that position's."""

    def build(self, x_shape, positions_shape=None):
        self.embeddings = self.add_weight(
            name="embeddings", shape=tuple(x_shape[1:]),
            initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x, positions=None):
        embeddings = keras.ops.cast(self.embeddings, x.dtype)
        if positions is None:
            return x + embeddings
        return x + keras.ops.take(embeddings, positions, axis=0)


@register("gpt",
          loss=token_mean_loss,
          metrics=lambda: [bits_per_byte()],
          headline="bits_per_byte",
          tokens_per_example=lambda kwargs: kwargs.get("context_length", 128),
          layout=lambda kwargs: gpt_layout_rules() + lora.factor_rules(
              gpt_layout_rules(), _adapted_targets(kwargs)))
def gpt(vocab_size=256, context_length=128, width=128, depth=4, num_heads=4,
        mlp_ratio=4, dropout=0.0, lora_rank=0, lora_alpha=lora.DEFAULT_ALPHA, lora_targets=(),
        lora_rslora=False, example_end_token=-1):
    """A decoder-only transformer LM; returns logits (batch, context_length, vocab_size).

    Pre-norm blocks of causal multi-head attention and a GELU MLP, with
    learned position embeddings; inputs are int32 token ids of shape
    (batch, context_length).

    Args:
        vocab_size: int, default 256. Tokens in the vocabulary (256: bytes).
        context_length: int, default 128. Tokens per sequence.
        width: int, default 128. The model width (embedding size).
        depth: int, default 4. Transformer blocks.
        num_heads: int, default 4. Attention heads; must divide `width`.
        mlp_ratio: int, default 4. MLP hidden units per unit of width.
        dropout: float, default 0.0. Dropout rate on attention weights and on
            each block's residual branches.
        lora_rank, lora_alpha, lora_targets, lora_rslora: LoRA as PEFT defines
            it (`models.lora`) on `LORA_TARGETS`; rank 0: every weight trains.
        example_end_token: int, default -1. A token id that ends each example of a
            row packed apart (`models.segments`): attention stays inside an example
            and positions restart at its first token. -1: a row is one stream (the run
            sets it from the data).
    """
    tokens = keras.Input((context_length,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab_size, width, name="token_embedding",
                         embeddings_initializer=keras.initializers.RandomNormal(stddev=0.02))(tokens)
    mask = None
    if example_end_token >= 0:  # examples packed apart: each its own positions and attention
        ids = segments.example_ids(tokens, example_end_token)
        x = PositionEmbedding(name="position_embedding")(x, positions=segments.positions(ids))
        mask = segments.same_example(ids)
    else:
        x = PositionEmbedding(name="position_embedding")(x)
    for i in range(depth):
        h = layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_attention_norm")(x)
        h = layers.MultiHeadAttention(num_heads, key_dim=width // num_heads, dropout=dropout,
                                      name=f"block{i}_attention")(h, h, attention_mask=mask,
                                                                  use_causal_mask=True)
        x = x + layers.Dropout(dropout)(h)
        h = layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_mlp_norm")(x)
        h = layers.Dense(mlp_ratio * width, activation="gelu", name=f"block{i}_mlp_up")(h)
        h = layers.Dense(width, name=f"block{i}_mlp_down")(h)
        x = x + layers.Dropout(dropout)(h)
    x = layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
    logits = layers.Dense(vocab_size, name="lm_head", dtype="float32")(x)
    model = keras.Model(tokens, logits, name="gpt")
    settings = _lora_settings(dict(lora_rank=lora_rank, lora_alpha=lora_alpha,
                                   lora_targets=lora_targets, lora_rslora=lora_rslora))
    if settings is not None:
        lora.attach(model, LORA_TARGETS, settings)
    return model


def _lora_settings(kwargs):
    return lora.settings(kwargs, LORA_TARGETS, LORA_DEFAULT, "gpt")


def _adapted_targets(kwargs) -> list:
    settings = _lora_settings(kwargs)
    return [t for t in LORA_TARGETS if settings and t.module in settings.modules]


def gpt_layout_rules() -> list[Rule]:
    """Megatron-style tensor parallelism over the `model` mesh axis.

    Each block splits its attention heads and its MLP hidden units over
    `model`: QKV and MLP-up are column-parallel (outputs split), attention-out
    and MLP-down row-parallel (inputs split), so each block needs one
    all-reduce forward and one backward. The vocabulary is split in the
    embedding and the head. The `data` axis only splits the batch.
    Shapes use V vocab, L context, W width, H heads, K = W / H, F = mlp_ratio x W.
    """
    return [
        # token_embedding/embeddings                      (V, W)
        Rule(r"token_embedding/embeddings", ("model", None)),
        # position_embedding/embeddings                   (L, W)  added to the residual
        # stream, which stays whole: split over W, it would split the stream, and XLA
        # then all-gathers it before every matmul (seen in the compiled step's collectives)
        replicated(r"position_embedding/embeddings"),
        # block{i}_attention/{query,key,value}/kernel     (W, H, K)
        Rule(r"block\d+_attention/(query|key|value)/kernel", (None, "model", None)),
        # block{i}_attention/{query,key,value}/bias       (H, K)
        Rule(r"block\d+_attention/(query|key|value)/bias", ("model", None)),
        # block{i}_attention/attention_output/kernel      (H, K, W)
        Rule(r"block\d+_attention/attention_output/kernel", ("model", None, None)),
        # block{i}_attention/attention_output/bias        (W,)  added after the all-reduce
        replicated(r"block\d+_attention/attention_output/bias"),
        # block{i}_mlp_up/kernel                          (W, F)
        Rule(r"block\d+_mlp_up/kernel", (None, "model")),
        # block{i}_mlp_up/bias                            (F,)
        Rule(r"block\d+_mlp_up/bias", ("model",)),
        # block{i}_mlp_down/kernel                        (F, W)
        Rule(r"block\d+_mlp_down/kernel", ("model", None)),
        # block{i}_mlp_down/bias                          (W,)  added after the all-reduce
        replicated(r"block\d+_mlp_down/bias"),
        # block{i}_{attention,mlp}_norm/{gamma,beta}, final_norm/{gamma,beta}   (W,)
        replicated(r"(block\d+_(attention|mlp)_norm|final_norm)/(gamma|beta)"),
        # lm_head/kernel                                  (W, V)
        Rule(r"lm_head/kernel", (None, "model")),
        # lm_head/bias                                    (V,)
        Rule(r"lm_head/bias", ("model",)),
    ]
