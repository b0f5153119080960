"""A causal LM's loss that never holds the whole logits: `train.loss_chunks`.

A language model's logits, tokens x vocabulary in float32, are the largest
tensor of a long-context step: 4 GiB for one sequence of 8,192 tokens over
Llama 3's 128,256 entries, kept for the backward pass. With
`train.loss_chunks` n above 1, the output head and the cross-entropy run on
n pieces of the sequence one after another, each piece's logits reduced to
its tokens' negative log-likelihoods at once and computed again in the
backward pass (`keras.remat`: `jax.checkpoint`, `tf.recompute_grad`): one
piece's logits exist at a time. The loss and its gradients are the whole
logits' (MaxText tiles the vocabulary for the same reason; here the
sequence is tiled, which keeps a vocabulary split over devices whole).

How: the steps (`training.jax_steps`, `training.tf_steps`) run the model's
forward pass inside `targets(y)`, and the head layer `attach` routed (a
keras-hub task's `ReversibleEmbedding`, the `gpt` builder's `lm_head`) then
returns each token's negative log-likelihood, (batch, length), instead of
its logits. The loss (`models.metrics.TokenMeanCrossEntropy`) and the
metrics read either, by rank. DPO's and GRPO's scores of a sequence take
their per-token log-probabilities the same way (`log_probs`, GRPO's logits
divided by its sampling temperature inside each piece). Outside `targets`
(generation, exports, `predict`) the head returns logits as always.
"""

# Imported inside functions: JAX (optional: the jax engine's alone; the tf engine loops in Python).
import contextlib

import keras

from tpu_keras.errors import UserError

_TARGETS: list = []  # (labels, temperature) of the forward pass in progress, innermost last


@contextlib.contextmanager
def targets(labels, temperature: float = 1.0):
    """While open, a routed head (`attach`) returns the negative log-likelihood of `labels`
    (batch, length) under its logits divided by `temperature`, rather than the logits."""
    _TARGETS.append((labels, temperature))
    try:
        yield
    finally:
        _TARGETS.pop()


def log_probs(model, inputs, labels, temperature: float = 1.0, training=None):
    """(rows, length) log-probabilities of `labels` under `model(inputs)`'s logits divided by
    `temperature`: from a chunked head's pieces where `attach` routed it, else from the
    whole logits."""
    with targets(labels, temperature):
        out = model(inputs, training=training)
    if len(out.shape) == len(labels.shape):  # the head's own negative log-likelihoods
        return -out
    logits = out if temperature == 1.0 else out / temperature
    return -keras.ops.sparse_categorical_crossentropy(labels, logits, from_logits=True)


def attach(model, chunks: int) -> bool:
    """Routes `model`'s output head through `per_token_nll` in `chunks` pieces of the sequence
    (nothing for 1); returns whether it did. A model without a head it knows is one `error:`
    line."""
    if chunks <= 1:
        return False
    head = find_head(model)
    if head is None:
        raise UserError(f"train.loss_chunks={chunks} splits a causal language model's output head "
                        f"and loss, and {model.name} has none the toolkit knows (a keras-hub causal "
                        "LM's token embedding, the gpt builder's lm_head); set train.loss_chunks=1")
    call = head.call

    def routed(inputs, *args, **kwargs):
        labels, temperature = _TARGETS[-1] if _TARGETS else (None, 1.0)
        if labels is None or not _reverse(head, args, kwargs):
            return call(inputs, *args, **kwargs)
        if labels.shape[-1] % chunks:
            raise UserError(f"train.loss_chunks={chunks} does not divide the sequence's "
                            f"{labels.shape[-1]} tokens; pick a divisor of it")
        weights, logits_of = _head_function(head)
        return per_token_nll(logits_of, inputs, labels, weights, chunks, temperature)

    object.__setattr__(head, "call", routed)
    return True


def find_head(model):
    """The layer that makes `model`'s logits: a keras-hub causal LM's `ReversibleEmbedding`
    (called in reverse), else a Dense layer named `lm_head` (the `gpt` builder's); None."""
    for layer in model._flatten_layers(include_self=False):
        backbone = getattr(layer, "backbone", None)
        if backbone is not None and isinstance(getattr(backbone, "token_embedding", None),
                                               keras.layers.ReversibleEmbedding):
            return backbone.token_embedding
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.Dense) and layer.name == "lm_head":
            return layer
    return None


def _reverse(head, args, kwargs) -> bool:
    """Whether this call of `head` makes logits (a ReversibleEmbedding's reverse call)."""
    if not isinstance(head, keras.layers.ReversibleEmbedding):
        return True
    return bool(kwargs.get("reverse", args[0] if args else False))


def _head_function(head):
    """([the head's weights as values], f(hidden, *weights) -> logits): the head's own call
    (Keras 3.15's `ReversibleEmbedding.call(reverse=True)`, `Dense.call`) with its weights as
    arguments, so that the recomputation differentiates them."""
    if isinstance(head, keras.layers.ReversibleEmbedding):
        tied, dtype, cap = head.tie_weights, head.reverse_dtype, head.logit_soft_cap

        def logits_of(hidden, kernel):
            kernel = keras.ops.transpose(kernel) if tied else kernel
            if dtype is not None:
                hidden, kernel = keras.ops.cast(hidden, dtype), keras.ops.cast(kernel, dtype)
            logits = keras.ops.matmul(hidden, kernel)
            return logits if cap is None else keras.ops.multiply(keras.ops.tanh(logits / cap), cap)
        return [(head.embeddings if tied else head.reverse_embeddings).value], logits_of

    def dense_logits(hidden, kernel, *bias):  # an lm_head has no activation
        logits = keras.ops.matmul(hidden, keras.ops.cast(kernel, head.compute_dtype))
        return logits if not bias else keras.ops.add(logits, keras.ops.cast(bias[0], head.compute_dtype))
    return [head.kernel.value] + ([head.bias.value] if head.bias is not None else []), dense_logits


def per_token_nll(logits_of, hidden, labels, weights, chunks: int, temperature: float = 1.0):
    """(batch, length) float32: each token's negative log-likelihood of its label under
    `logits_of(hidden, *weights)` / `temperature`, computed over `chunks` pieces of the
    sequence, one at a time, each recomputed in the backward pass."""
    batch, length = labels.shape[0], labels.shape[-1]
    size = length // chunks

    def piece(h, y, *values):  # in float32, as the model's own logits are taken
        logits = keras.ops.cast(logits_of(h, *values), "float32")
        if temperature != 1.0:
            logits = logits / temperature
        return keras.ops.sparse_categorical_crossentropy(y, logits, from_logits=True)

    recomputed = keras.remat(piece)
    if keras.backend.backend() == "jax":  # one after another: a scan keeps one piece alive
        import jax
        import jax.numpy as jnp
        split = lambda t: jnp.moveaxis(jnp.reshape(t, (batch, chunks, size) + t.shape[2:]), 1, 0)
        nll = jax.lax.map(lambda pair: recomputed(*pair, *weights), (split(hidden), split(labels)))
        return jnp.reshape(jnp.moveaxis(nll, 0, 1), (batch, length))
    pieces = [recomputed(hidden[:, i * size:(i + 1) * size], labels[:, i * size:(i + 1) * size], *weights)
              for i in range(chunks)]
    return keras.ops.concatenate(pieces, axis=1)


def nats(y_true, y_pred):
    """Each token's cross-entropy: `y_pred` itself where a chunked head gave it (the labels'
    rank), else from `y_pred`'s logits."""
    if len(y_pred.shape) == len(y_true.shape):
        return y_pred
    return keras.ops.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)

