"""Splash attention, the TPU's fused attention kernel, for keras-hub models on the jax engine.

Why the toolkit routes it itself: Keras 3.15's `ops.dot_product_attention`
takes its TPU kernel only for a call with neither mask nor `is_causal`. Inside
a jitted step both make a traced mask, and Keras then falls back to XLA's
attention; without a mask, its kernel call on split inputs fails to compile
("Mosaic kernels cannot be automatically partitioned", keras-team/keras#21116).
keras-hub's Llama always passes a mask, so its training step on a TPU runs XLA's
attention, which keeps the scores (batch x heads x length x length) for the
backward pass. The compiled programs that show it: docs/performance.md.

Here each device runs the kernel on its own rows and heads (`jax.shard_map`
over the batch axes and `model`). The causal mask is static, and the kernel's
segment ids are the examples of a row packed apart (`models.segments`, each
token's example), else keras-hub's key padding (real tokens 1, padding 0). A
query that is a real token then attends exactly the keys keras-hub's mask
allows; a padding query attends earlier padding instead of earlier real
tokens, which changes only outputs the loss gives no weight to. A call the
kernel does not cover (a cache, a length that is not a multiple of 128,
or shorter than `SHORTEST`, where the kernel costs memory instead) goes to
keras-hub's own code.

The served classes differ in little, and `ADAPTERS` says it per class: the
query's scale, and a sliding window (Gemma 3's and 4's local layers: a static
`LocalMask` in place of the causal one). All hand `_compute_attention`
(batch, length, heads, head_dim) tensors; keys and values with fewer heads
than the query (Gemma 3's and 4's, grouped) are repeated to its heads here,
as Llama's and Qwen 3's layers do before the call.
"""

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import keras
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask
from jax.sharding import PartitionSpec

from tpu_keras.models import families, segments as segments_lib
from tpu_keras.parallelism.mesh import BATCH_AXES, CONTEXT

LANES = 128  # the kernel's blocks along the sequence are multiples of this
# Below this length the kernel cost HBM instead of saving it: compiled for a v5litepod-8, a
# 128-token Llama with heads of 32 peaked at 14.5 MiB per device with it and 7.5 without;
# at 512 tokens and heads of 64, 99 against 125 MiB (docs/performance.md).
SHORTEST = 512
BLOCKS = (512, 256, 128)  # the largest that divides the length is used: fewer, larger tiles


class Settings(NamedTuple):
    scale: float               # the query's, which the kernel does not apply
    window: Optional[int]      # keys a query sees, itself included (None: all earlier ones)


def _causal(layer) -> Settings:
    """Llama, SmolLM3, Qwen 3, Qwen3-MoE, Mixtral, Qwen 3.5's full attention layers: causal over all earlier keys,
    scaled by `_inv_norm_factor`. Qwen 3's `sliding_window_size` is left out as keras-hub's
    fused attention on jax leaves it out (and the family refuses a checkpoint with a window);
    Qwen 3.5's family turns it off."""
    return Settings(layer._inv_norm_factor, None)


def _gemma(layer) -> Optional[Settings]:
    """Gemma 3 and 4: `sliding_window_size` keys in the sliding layers (key j for query i where
    i - window < j <= i; Gemma 3 narrows the mask in `_mask_sliding_window`, Gemma 4's decoder
    block before the call). The scale: Gemma 3's by `query_head_dim_normalize`, none for Gemma 4
    (its query and key norms stand for it). None, keras-hub's own code, for what the kernel is
    not given: a soft cap, dropout of the scores, and the bidirectional mask of embedding models."""
    if layer.logit_soft_cap is not None or layer.dropout or layer.use_bidirectional_attention:
        return None
    if type(layer).__name__ == "Gemma4TextAttention":
        scale = 1.0
    else:
        size = layer.head_dim if layer.query_head_dim_normalize else layer.hidden_dim // layer.num_query_heads
        scale = 1 / math.sqrt(size)
    return Settings(scale, layer.sliding_window_size if layer.use_sliding_window_attention else None)


# Every class a family names in `fused_attention`: its layer -> Settings, or None for keras-hub's code.
ADAPTERS = {"LlamaAttention": _causal, "SmolLM3Attention": _causal, "Qwen3Attention": _causal,
            "Qwen3MoeAttention": _causal, "MixtralAttention": _causal,
            "Qwen3_5Attention": _causal, "CachedGemma3Attention": _gemma, "Gemma4TextAttention": _gemma}


def route(model, cluster) -> int:
    """Routes `model`'s attention through the kernel where `cluster`'s mesh holds TPUs (a
    TPU VM's, or a slice libtpu describes for its compiler); returns how many layers."""
    mesh = cluster.device_mesh
    if cluster.engine != "jax" or mesh is None:
        return 0
    first = mesh.devices.flat[0]  # a JAX device, or Keras's name for one ('cpu:0')
    platform = getattr(first, "platform", str(first).split(":")[0].lower())
    return route_layers(model) if platform == "tpu" else 0


def route_layers(model, interpret: bool = False, shortest: int = SHORTEST,
            one_device: bool = False) -> int:
    """Routes the attention of `model`'s layers of a known family through the kernel, for
    sequences of at least `shortest` tokens; returns how many layers it routed.
    `interpret` runs the kernel in Pallas's interpreter, on any device (the tests' way to
    check its numbers on a CPU). `one_device`: the kernel on the whole batch, with no
    distribution, as one device runs it on its rows; the memory plan traces that (the
    trace is never compiled) to count what the kernel keeps for the backward pass."""
    # The attention classes the families name (`Family.fused_attention`): each one's
    # `_compute_attention(query, key, value, attention_mask, ...)` gets (batch, length, heads,
    # head_dim) tensors and keras-hub's causal-and-padding mask.
    served = {name for family in families.known() for name in family.fused_attention}
    layers = list(model._flatten_layers(include_self=False))
    if any(getattr(layer, "vision_encoder", None) is not None for layer in layers):
        return 0  # Gemma 3's image tokens attend each other both ways: no causal mask
    routed = 0
    for layer in layers:
        if type(layer).__name__ in served and not getattr(layer, "_tpu_keras_splash", False):
            # An instance attribute: the layer's attention as it was (keras-hub's, or kept to
            # one example by `segments`) stays the fallback.
            object.__setattr__(layer, "_compute_attention", functools.partial(
                _attention, layer._compute_attention, ADAPTERS[type(layer).__name__], layer=layer,
                interpret=interpret, shortest=shortest, one_device=one_device))
            object.__setattr__(layer, "_tpu_keras_splash", True)
            routed += 1
    return routed


def covers(query_shape, key_shape, shortest: int = SHORTEST) -> bool:
    """Whether the kernel takes a call of these shapes: self-attention (no cache) of at least
    `shortest` tokens, in whole tiles of 128 (its blocks are multiples of a TPU register's
    128 lanes)."""
    length = query_shape[1]
    return key_shape[1] == length and length % LANES == 0 and length >= shortest


def _attention(fallback, adapter, query, key, value, attention_mask=None, *, layer, interpret,
               shortest, one_device=False, **kwargs):
    """`kwargs`: what the class passes beside (Qwen 3's and SmolLM3's `cache_update_index`,
    Gemma 3's `training` too), for its own code."""
    distribution = keras.distribution.distribution()
    settings = adapter(layer)
    if (distribution is None and not one_device) or settings is None \
            or not covers(query.shape, key.shape, shortest):
        return fallback(query, key, value, attention_mask, **kwargs)
    examples = segments_lib.current_ids()
    if examples is not None:  # a row of examples packed apart: one segment each
        segments = jnp.asarray(examples, jnp.int32)
    elif attention_mask is None:
        segments = jnp.ones(query.shape[:2], jnp.int32)
    else:  # keras-hub's mask is min(key padding, causal), and Gemma 4's also narrowed to its
        # window: a key some query sees (a real one sees itself) is real. A reduction, which the
        # compiler fuses with the mask's making; the mask's diagonal (a gather) made it keep the
        # whole mask: a 2-layer Llama's peak on a v5litepod-8 went from 23 to 154 MB.
        segments = jnp.max(attention_mask.astype(jnp.int32), axis=1)
    query = query * jnp.asarray(settings.scale, query.dtype)  # the kernel does not scale
    if key.shape[2] != query.shape[2]:  # grouped: key head h // groups serves query head h
        groups = query.shape[2] // key.shape[2]
        key, value = jnp.repeat(key, groups, axis=2), jnp.repeat(value, groups, axis=2)
    kernel = functools.partial(_local, window=settings.window, interpret=interpret)
    if one_device:
        return kernel(query, key, value, segments)
    mesh = distribution.device_mesh.backend_mesh
    heads = "model" if query.shape[2] % mesh.shape["model"] == 0 else None
    if mesh.shape.get(CONTEXT, 1) > 1:
        if (query.shape[1] // mesh.shape[CONTEXT]) % LANES:  # each device's queries in whole tiles
            return fallback(query, key, value, attention_mask, **kwargs)
        return _split_sequence(query, key, value, segments, mesh, heads, settings.window, interpret)
    rows = PartitionSpec(BATCH_AXES, None, heads, None)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(rows, rows, rows, PartitionSpec(BATCH_AXES)),
                         out_specs=rows, check_vma=False)(query, key, value, segments)


def _split_sequence(query, key, value, segments, mesh, heads, window, interpret):
    """The kernel on a sequence split over `context` (`models.context_attention`): each device
    its own queries against every key and value of the sequence, gathered along the axis,
    the mask's rows of its queries (the kernel's `q_seq_shards`, its mask split alike)."""
    context = mesh.shape[CONTEXT]
    local_heads = query.shape[2] // (mesh.shape["model"] if heads else 1)
    splash = _kernel(query.shape[1], local_heads, window, interpret, q_seq_shards=context)
    kernel_spec = splash.manual_sharding_spec(jax.sharding.NamedSharding(mesh, PartitionSpec(None, CONTEXT)))
    queries = PartitionSpec(BATCH_AXES, CONTEXT, heads, None)
    whole = PartitionSpec(BATCH_AXES, None, heads, None)

    def local(splash, q, k, v, q_ids, kv_ids):
        def one_row(q, k, v, q_ids, kv_ids):
            return splash(q, k, v, segment_ids=splash_attention_kernel.SegmentIds(q=q_ids, kv=kv_ids))
        heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
        out = jax.vmap(one_row)(heads_first(q), heads_first(k), heads_first(v), q_ids, kv_ids)
        return heads_first(out).astype(q.dtype)

    return jax.shard_map(local, mesh=mesh, in_specs=(kernel_spec, queries, whole, whole,
                                                     PartitionSpec(BATCH_AXES, CONTEXT), PartitionSpec(BATCH_AXES)),
                         out_specs=queries, check_vma=False)(splash, query, key, value, segments, segments)


def mask(length: int, window: Optional[int]):
    """One head's static mask: causal, or the `window` latest keys, the query's own included
    (`LocalMask` sees key j for query i where i - left <= j <= i + right)."""
    if window is None:
        return splash_attention_mask.CausalMask((length, length))
    return splash_attention_mask.LocalMask((length, length), window_size=(window - 1, 0), offset=0)


def _kernel(length: int, heads: int, window, interpret, q_seq_shards: int = 1):
    """The kernel for `heads` heads of a sequence of `length` (its mask's rows split in
    `q_seq_shards`, for a sequence split over devices)."""
    block = next(size for size in BLOCKS if (length // q_seq_shards) % size == 0)
    mask_all = splash_attention_mask.MultiHeadMask([mask(length, window)] * heads)
    sizes = splash_attention_kernel.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    return splash_attention_kernel.make_splash_mha(
        mask_all, block_sizes=sizes, head_shards=1, q_seq_shards=q_seq_shards, interpret=interpret)


def _local(query, key, value, segments, *, window, interpret):
    """One device's rows and heads: (batch, length, heads, head_dim) in and out."""
    kernel = _kernel(query.shape[1], query.shape[2], window, interpret)

    def one_row(q, k, v, ids):
        return kernel(q, k, v, segment_ids=splash_attention_kernel.SegmentIds(q=ids, kv=ids))

    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    out = jax.vmap(one_row)(heads_first(query), heads_first(key), heads_first(value), segments)
    return heads_first(out).astype(query.dtype)
