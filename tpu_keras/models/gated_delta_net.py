"""Qwen 3.5's Gated DeltaNet over a packed row, each example on its own.

Three of Qwen 3.5's four layers are keras-hub's `Qwen3_5GatedDeltaNet`, linear
attention: a recurrent state runs along the whole row, and a causal
convolution mixes each token with the three before it. Neither is attention
that a mask reaches (`segments`), so in a row of packed examples each example
would read the ones before it. `call_within_examples` is the layer's forward
pass without a cache (training, evaluation) given each token's example id: the
convolution's taps see only tokens of the token's own example, and the gated
delta rule starts from a zero state at each example's first token, so an
example's output is what it is alone. It calls the layer's own sublayers and
reads its own weights, so LoRA-wrapped or quantized projections still work.

The rule is keras-hub's chunked form (transformers' `torch_chunk_gated_delta_rule`):
within a chunk every matrix also requires the same example, its decays are
sums over one example only (no huge negative gate at a start, whose float32
cumulative sum would lose the small ones), and the state a chunk receives
reaches only the tokens of the example the previous chunk ended in. Where
keras-hub unrolls a 63-step Python loop (the within-chunk inverse, row by row)
and one step per chunk, this inverts by doubling blocks (ten matrix products
for 64 tokens, exact, and stable where the Neumann series' powers are huge)
and carries the state across chunks in a loop of one traced step: a
4-layer model compiles in about a fifth of the time on both engines.
"""

import keras
from keras import ops

CHUNK_SIZE = 64  # tokens per chunk: keras-hub's and transformers' (tests set a smaller one)


def call_within_examples(layer, hidden_states, ids, attention_mask=None, chunk_size=None):
    """`layer`'s (a keras-hub `Qwen3_5GatedDeltaNet`) call without a cache, each example of
    the row apart: `ids` (batch, length) is each token's example, those of one example
    contiguous. Call it inside the layer's own call (its weights autocast as keras-hub's)."""
    if attention_mask is not None and len(attention_mask.shape) == 2:  # as keras-hub does
        hidden_states = hidden_states * ops.cast(ops.expand_dims(attention_mask, -1), hidden_states.dtype)
    length = hidden_states.shape[1]
    mixed = causal_conv(layer.in_proj_qkv(hidden_states), layer.conv1d_weight, ids)
    mixed = mixed * ops.sigmoid(mixed)
    key_dim, head_k, head_v = layer.key_dim, layer.head_k_dim, layer.head_v_dim
    query = ops.reshape(mixed[..., :key_dim], (-1, length, layer.num_k_heads, head_k))
    key = ops.reshape(mixed[..., key_dim:2 * key_dim], (-1, length, layer.num_k_heads, head_k))
    value = ops.reshape(mixed[..., 2 * key_dim:], (-1, length, layer.num_v_heads, head_v))
    beta = ops.sigmoid(layer.in_proj_b(hidden_states))
    a = ops.cast(layer.in_proj_a(hidden_states), "float32")
    g = -ops.exp(ops.cast(layer.A_log, "float32")) * keras.activations.softplus(
        a + ops.cast(layer.dt_bias, "float32"))
    if layer.num_v_heads // layer.num_k_heads > 1:
        query = ops.repeat(query, layer.num_v_heads // layer.num_k_heads, axis=2)
        key = ops.repeat(key, layer.num_v_heads // layer.num_k_heads, axis=2)
    core = chunk_gated_delta_rule(query, key, value, g, beta, ids, chunk_size or CHUNK_SIZE)
    z = ops.reshape(layer.in_proj_z(hidden_states), (-1, head_v))
    core = layer.norm(ops.reshape(core, (-1, head_v))) * keras.activations.silu(z)
    return layer.out_proj(ops.reshape(core, (-1, length, layer.value_dim)))


def causal_conv(x, weight, ids):
    """keras-hub's causal depthwise convolution of `x` (batch, length, channels) with
    `weight` (channels, taps), each tap only from tokens of the same example: as if each
    example were alone, zeros before its first token."""
    taps, length = weight.shape[-1], x.shape[1]
    out = x * weight[:, taps - 1]
    for shift in range(1, min(taps, length)):
        earlier = ops.pad(x[:, :-shift], [[0, 0], [shift, 0], [0, 0]])
        same = ops.equal(ops.pad(ids[:, :-shift], [[0, 0], [shift, 0]], constant_values=-1), ids)
        out = out + earlier * ops.expand_dims(ops.cast(same, x.dtype), -1) * weight[:, taps - 1 - shift]
    return out


def chunk_gated_delta_rule(query, key, value, g, beta, ids, chunk_size=CHUNK_SIZE):
    """keras-hub's `_chunk_gated_delta_rule` from a zero state, nothing crossing from one
    example to another: (batch, length, heads, dim) query, key and value, (batch, length,
    heads) g (log decay) and beta, (batch, length) ids -> (batch, length, heads, value dim),
    in the query's dtype; float32 inside."""
    dtype, length, heads = query.dtype, query.shape[1], query.shape[2]
    chunks = -(-length // chunk_size)
    pad = chunks * chunk_size - length

    def blocks(x):  # (batch, length, heads, ...) -> float32 (batch, heads, chunks, chunk, ...)
        x = ops.moveaxis(ops.cast(x, "float32"), 1, 2)
        x = ops.pad(x, [[0, 0], [0, 0], [0, pad]] + [[0, 0]] * (len(x.shape) - 3))
        return ops.reshape(x, (-1, heads, chunks, chunk_size) + tuple(x.shape[3:]))

    # l2-normalized in the input dtype, then float32, as keras-hub and transformers do
    q = blocks(_l2norm(query)) * (query.shape[-1] ** -0.5)
    k, v, g, beta = blocks(_l2norm(key)), blocks(value), blocks(g), blocks(beta)
    ids = ops.reshape(ops.pad(ids, [[0, 0], [0, pad]], constant_values=-1), (-1, 1, chunks, chunk_size))
    order = ops.arange(chunk_size)
    causal = ops.expand_dims(order, -1) >= ops.expand_dims(order, 0)  # (query i, key j): j <= i
    within = ops.logical_and(ops.equal(ops.expand_dims(ids, -1), ops.expand_dims(ids, -2)), causal)
    decay_log = _cumsum_within(g, ids)  # from the chunk's or the example's first token, inclusive
    # exp(sum of g over (j, i]) where j <= i in one example, else 0 (no exp of a positive sum)
    decay = ops.where(within, ops.exp(ops.where(within, ops.expand_dims(decay_log, -1)
                                                - ops.expand_dims(decay_log, -2), 0.0)), 0.0)
    k_beta = k * ops.expand_dims(beta, -1)
    strict = ops.logical_and(within, ops.expand_dims(order, -1) > ops.expand_dims(order, 0))
    lower = ops.where(strict, ops.matmul(k_beta, ops.swapaxes(k, -1, -2)) * decay, 0.0)
    # the state a chunk receives is the example its previous chunk ended in: that example's tokens
    previous = ops.concatenate([ids[:, :, :1, :1], ids[:, :, :-1, -1:]], axis=2)
    carried = ops.cast(ops.equal(ids, previous), "float32")  # (batch, 1, chunks, chunk)
    from_start = ops.exp(decay_log) * carried
    written = ops.concatenate([v * ops.expand_dims(beta, -1),
                               k_beta * ops.expand_dims(ops.exp(decay_log), -1)], axis=-1)
    solved = ops.matmul(_unit_lower_inverse(lower), written)  # keras-hub's attn @ written
    values = solved[..., :v.shape[-1]]
    decayed_keys = solved[..., v.shape[-1]:] * ops.expand_dims(carried, -1)
    # the state a chunk hands on: its last token's example's
    last = within[..., -1, :]
    last_keys = k * ops.expand_dims(ops.where(last, ops.exp(ops.where(
        last, decay_log[..., -1:] - decay_log, 0.0)), 0.0), -1)
    state_decay = ops.expand_dims(ops.expand_dims(from_start[..., -1], -1), -1)

    def step(state, chunk):  # the state a chunk hands on
        decayed_keys_c, values_c, last_keys_c, state_decay_c = chunk
        new = values_c - ops.matmul(decayed_keys_c, state)
        return state_decay_c * state + ops.matmul(ops.swapaxes(last_keys_c, -1, -2), new)

    zero = (ops.zeros_like(ops.swapaxes(k[:, :, 0, :1], -1, -2))
            + ops.zeros_like(v[:, :, 0, :1]))  # (batch, heads, key dim, value dim)
    states = _received(step, zero, [ops.moveaxis(x, 2, 0) for x in (
        decayed_keys, values, last_keys, state_decay)])
    states = ops.moveaxis(states, 0, 2)  # each chunk's received state
    new = values - ops.matmul(decayed_keys, states)
    out = (ops.matmul(q * ops.expand_dims(from_start, -1), states)
           + ops.matmul(ops.matmul(q, ops.swapaxes(k, -1, -2)) * decay, new))
    out = ops.reshape(out, (-1, heads, chunks * chunk_size, v.shape[-1]))[:, :, :length]
    return ops.cast(ops.moveaxis(out, 1, 2), dtype)


def _received(step, zero, chunks):
    """The state each chunk receives, (chunks, ...), from `zero` through `step` (state, the
    chunk's slices of `chunks`) -> the next. jax: a scan. tf: a while loop with its bound,
    since XLA differentiates no tf loop without one (Keras's scan and fori_loop give none)."""
    if keras.backend.backend() != "tensorflow":
        return ops.scan(lambda state, chunk: (step(state, chunk), state), zero, chunks)[1]
    count = chunks[0].shape[0]

    def body(i, state, states):
        states = ops.scatter_update(states, ops.reshape(i, (1, 1)), ops.expand_dims(state, 0))
        return i + 1, step(state, [ops.take(x, i, axis=0) for x in chunks]), states

    states = ops.zeros((count,) + (1,) * len(zero.shape)) + ops.expand_dims(zero, 0)
    return ops.while_loop(lambda i, state, states: i < count, body, (0, zero, states),
                          maximum_iterations=count)[2]


def _l2norm(x, eps=1e-6):
    return x * ops.rsqrt(ops.sum(x * x, axis=-1, keepdims=True) + eps)


def _unit_lower_inverse(lower):
    """(I + lower)^-1 for `lower` (..., n, n) strictly lower triangular, by doubling the
    inverted diagonal blocks (1, 2, 4, ... wide): the inverse of [[A, 0], [C, D]] is
    [[A^-1, 0], [-D^-1 C A^-1, D^-1]], every block of the inverse at once. Two matrix
    products a doubling; each product is of blocks of the inverse itself (the Neumann
    series' powers of `lower` grow huge where keys align, and float32 loses the inverse)."""
    size, order = lower.shape[-1], ops.arange(lower.shape[-1])

    def between_halves(width):  # (row, column) in one 2 * width block, not in one width block
        return ops.logical_and(ops.equal(ops.expand_dims(order // (2 * width), -1), order // (2 * width)),
                               ops.not_equal(ops.expand_dims(order // width, -1), order // width))

    inverse, width = ops.eye(size) - ops.where(between_halves(1), lower, 0.0), 2
    while width < size:
        inverse = inverse - ops.matmul(inverse, ops.matmul(ops.where(between_halves(width), lower, 0.0),
                                                           inverse))
        width *= 2
    return inverse


def _cumsum_within(g, ids):
    """The cumulative sum of `g` along its last axis, restarted where `ids` changes: log2(size)
    doubling steps (Hillis-Steele), each adding the sum `shift` tokens earlier where that
    token is of the same example."""
    size, shift = g.shape[-1], 1
    widths = [[0, 0]] * (len(g.shape) - 1)
    while shift < size:
        same = ops.equal(ops.pad(ids[..., :-shift], widths + [[shift, 0]], constant_values=-1), ids)
        g = g + ops.where(same, ops.pad(g[..., :-shift], widths + [[shift, 0]]), 0.0)
        shift *= 2
    return g
