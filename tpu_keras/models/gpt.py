"""`gpt`: a decoder-only transformer language model (pre-norm, learned positions).

Layers are named per block (`block0_attention`, `block0_mlp_up`, ...) so that
weight paths are stable and readable for layout rules and checkpoints.
"""

import keras
from keras import layers

from tpu_keras.models.metrics import bits_per_byte
from tpu_keras.models.registry import register


class PositionEmbedding(layers.Layer):
    """Adds a learned vector per position to a (batch, length, width) input."""

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            name="embeddings", shape=tuple(input_shape[1:]),
            initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
        return x + keras.ops.cast(self.embeddings, x.dtype)


@register("gpt",
          loss=lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
          metrics=lambda: [bits_per_byte()],
          headline="bits_per_byte",
          tokens_per_example=lambda kwargs: kwargs.get("context_length", 128))
def gpt(vocab_size=256, context_length=128, width=128, depth=4, num_heads=4,
        mlp_ratio=4, dropout=0.0):
    """Returns logits of shape (batch, context_length, vocab_size) for int32 tokens."""
    tokens = keras.Input((context_length,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab_size, width, name="token_embedding",
                         embeddings_initializer=keras.initializers.RandomNormal(stddev=0.02))(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    for i in range(depth):
        h = layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_attention_norm")(x)
        h = layers.MultiHeadAttention(num_heads, key_dim=width // num_heads, dropout=dropout,
                                      name=f"block{i}_attention")(h, h, use_causal_mask=True)
        x = x + layers.Dropout(dropout)(h)
        h = layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_mlp_norm")(x)
        h = layers.Dense(mlp_ratio * width, activation="gelu", name=f"block{i}_mlp_up")(h)
        h = layers.Dense(width, name=f"block{i}_mlp_down")(h)
        x = x + layers.Dropout(dropout)(h)
    x = layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
    logits = layers.Dense(vocab_size, name="lm_head", dtype="float32")(x)
    return keras.Model(tokens, logits, name="gpt")
