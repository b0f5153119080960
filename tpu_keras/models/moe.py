"""Sparse mixture-of-experts layers for keras-hub's MoE families on the jax engine.

Why the toolkit computes them itself: keras-hub 0.32's MoE blocks (Mixtral,
Qwen3-MoE, Qwen 3.5's MoE, gpt-oss) run every expert on every token
(`einsum("th,ehm->etm")` over all E experts, then a weighted sum), "due to
the lack of `ragged_dot` support in the Keras ops API". That is E / top_k
times the experts' real FLOPs (16x for Qwen3-30B-A3B), and an E x tokens x
units activation.

Here each token's k copies are sorted by the expert the router chose, each
expert multiplies its own rows (`jax.lax.ragged_dot`: a grouped matmul, which
the TPU's compiler costs at the rows it has), and the copies come back
weighted by the router. The weights are keras-hub's own variables, read
where they are (no conversion on load or export); the block keeps its
keras-hub call as the fallback for what this path does not cover (a
backend other than jax).

On a mesh with an `expert` axis each device holds E / expert of the experts
(`ADAPTERS` name the weights; the families' layout rules split them), inside
a `jax.shard_map`. Dropless on a TPU, each device sends each copy of its
tokens to the device holding the copy's expert, and gets the products back,
by `jax.lax.ragged_all_to_all` (`_exchanged`): a device sends T x k rows,
not the axis's tokens. XLA:CPU has no such collective, so elsewhere (and
under a capacity) a device gathers the tokens of the devices along
`expert`, computes the rows of its own experts, and sums the results back
to the tokens' own devices (`psum_scatter`). The units of each expert may
be split over `model` as well (their partial sums are added over it).

Dropless by default, as transformers computes the layer: static shapes
then hold every copy a device's experts could be sent. A capacity factor c
keeps at most ceil(c x tokens x k / E) copies per expert (the earliest
tokens of a batch first) in fixed slots, multiplied expert by expert as one
batch, and drops the rest, which are counted: a device then holds its own
experts' slots alone.

The experts' load (tokens per expert, copies dropped) of a train step's
forward pass is recorded for its log line (`recorded_load`).

The router's load-balancing loss is transformers' `load_balancing_loss_func`
over all MoE layers at once (the last layer adds it, from every layer's router
statistics of the same forward pass), times the family's coefficient (the
backbone's `router_aux_loss_coef`-like argument, which `model.*` sets). keras-hub
adds each layer's own loss in full: L terms, each of one layer alone.
"""

# Imported inside functions: JAX (optional: absent on a plain install; the tf engine keeps
# keras-hub's dense bank and asks this module only which blocks a model has).
import contextlib
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import keras

from tpu_keras.errors import UserError
from tpu_keras.models import expert_lora
from tpu_keras.parallelism.mesh import BATCH_AXES, CONTEXT

EXPERT = "expert"
BUSIEST, DROPPED = "experts_busiest", "experts_dropped"  # the log keys of the experts' load


class Bank(NamedTuple):
    """One block's experts as arrays, E first: gate and up (E, H, F), down (E, F, H), and
    the biases gpt-oss has (gate and up (E, F), down (E, H)), else None."""
    gate: Any
    up: Any
    down: Any
    gate_bias: Any = None
    up_bias: Any = None
    down_bias: Any = None


class Block(NamedTuple):
    """What a keras-hub MoE block class is to this layer (`ADAPTERS`)."""
    router: Optional[Callable]  # layer -> its router's Dense layer (logits over the experts);
    #                             None: the router is keras-hub's, and `dispatched` routes
    bank: Callable              # layer -> Bank (arrays in the compute dtype)
    activation: Callable        # (gate, up) -> units, float32 where transformers computes so
    softmax_first: bool         # softmax over all experts, then top-k (else top-k of the logits)
    normalize: Callable         # layer -> whether the top-k weights are scaled to sum to 1
    coefficient: Callable       # layer -> the load-balancing loss's coefficient
    shared: Optional[Callable] = None  # layer, tokens -> the shared expert's output (Qwen 3.5)
    top_k: Callable = lambda layer: layer.top_k  # layer -> the experts each token takes
    # layer -> the layer that holds the experts' weights
    bank_layer: Callable = lambda layer: getattr(layer, "expert_bank", None) or layer.experts
    applies: Callable = lambda layer: True  # layer -> whether this one has experts
    # layer, (weights, experts) -> the weights to combine with (Gemma 4's per-expert scale)
    scaled: Callable = lambda layer, weights, experts: weights


def _value(variable, dtype):
    import jax.numpy as jnp
    return jnp.asarray(keras.ops.convert_to_tensor(variable), dtype)


def _silu_glu(gate, up):
    """Mixtral's, Qwen3-MoE's, Qwen 3.5's: up x silu(gate), the SiLU in float32 as keras-hub's."""
    import jax
    import jax.numpy as jnp
    return up * jax.nn.silu(gate.astype(jnp.float32)).astype(up.dtype)


def _gpt_oss_glu(gate, up, alpha=1.702, limit=7.0):
    """gpt-oss's clamped GLU (transformers' GptOssExperts, keras-hub's GptOssExperts)."""
    import jax
    import jax.numpy as jnp
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def _halves(layer, dtype) -> Bank:
    """Qwen3-MoE's and Qwen 3.5's bank: gate and up fused along the units, gate first (their
    LoRA updates merged in, `expert_lora`)."""
    bank = layer.expert_bank
    gate_up = _value(expert_lora.weight(bank, "_expert_feedforward_gate_dense"), dtype)
    units = gate_up.shape[-1] // 2
    return Bank(gate_up[..., :units], gate_up[..., units:],
                _value(expert_lora.weight(bank, "_expert_feedforward_output_dense"), dtype))


def _mixtral_bank(layer, dtype) -> Bank:
    bank = layer.expert_bank
    return Bank(_value(bank._expert_feedforward_gate_dense, dtype),
                _value(bank._expert_feedforward_intermediate_dense, dtype),
                _value(bank._expert_feedforward_output_dense, dtype))


def _gpt_oss_bank(layer, dtype) -> Bank:
    """gpt-oss's: gate and up interleaved along the units (gate the even ones), with biases;
    LoRA's update merged into the stacked weights where they are adapted (`expert_lora`)."""
    experts = layer.experts
    gate_up = _value(expert_lora.weight(experts, "gate_up_proj"), dtype)
    bias = _value(experts.gate_up_proj_bias, dtype)
    return Bank(gate_up[..., ::2], gate_up[..., 1::2], _value(expert_lora.weight(experts, "down_proj"), dtype),
                bias[..., ::2], bias[..., 1::2], _value(experts.down_proj_bias, dtype))


def _gelu_glu(gate, up):
    """Gemma 4's: up x gelu(gate) (tanh's approximation), the GELU in float32 as keras-hub's."""
    import jax
    import jax.numpy as jnp
    return up * jax.nn.gelu(gate.astype(jnp.float32), approximate=True).astype(up.dtype)


def _gemma4_bank(layer, dtype) -> Bank:
    bank = layer.moe_expert_bank
    return Bank(_value(bank.gate_proj, dtype), _value(bank.up_proj, dtype), _value(bank.down_proj, dtype))


def _gemma4_scaled(layer, weights, experts):
    """Each chosen expert's weight times its learned output scale (keras-hub scales the
    expert's output, transformers the weight: the same product)."""
    import jax.numpy as jnp
    return weights * jnp.asarray(keras.ops.convert_to_tensor(layer.moe_expert_bank.per_expert_scale),
                                 weights.dtype)[experts]


def _qwen3_5_shared(layer, tokens):
    """Qwen 3.5's shared expert, gated by a sigmoid of its own projection (keras-hub's)."""
    import jax
    return jax.nn.sigmoid(layer._shared_expert_gate(tokens)) * layer.shared_expert(tokens)


ADAPTERS = {
    "Qwen3SparseMoeBlock": Block(
        router=lambda layer: layer._sparse_feedforward_gate_dense, bank=_halves, activation=_silu_glu,
        softmax_first=True, normalize=lambda layer: layer.norm_top_k_prob,
        coefficient=lambda layer: layer.router_aux_loss_coefficient),
    "MixtralSparseMoeBlock": Block(
        router=lambda layer: layer._sparse_feedforward_gate_dense, bank=_mixtral_bank,
        activation=_silu_glu, softmax_first=True, normalize=lambda layer: True,
        coefficient=lambda layer: layer.router_aux_loss_coef),
    "Qwen3_5MoeSparseMoeBlock": Block(
        router=lambda layer: layer._router_gate, bank=_halves, activation=_silu_glu,
        softmax_first=True, normalize=lambda layer: True,
        coefficient=lambda layer: layer.router_aux_loss_coefficient, shared=_qwen3_5_shared),
    "GptOssSparseMoeBlock": Block(
        router=lambda layer: layer.router.router_dense, bank=_gpt_oss_bank, activation=_gpt_oss_glu,
        softmax_first=False, normalize=lambda layer: True,
        coefficient=lambda layer: getattr(layer, "router_aux_loss_coefficient", 0.0)),
    # Gemma 4's MoE decoder blocks (26B-A4B): a dense MLP beside the experts, keras-hub's router
    # (`moe_router`: (T, E) weights, k of them non-zero) read by the bank (`dispatched`); no
    # balancing loss.
    "Gemma4TextDecoderBlock": Block(
        router=None, bank=_gemma4_bank, activation=_gelu_glu, softmax_first=True,
        normalize=lambda layer: True, coefficient=lambda layer: 0.0,
        top_k=lambda layer: layer.num_experts_per_token, bank_layer=lambda layer: layer.moe_expert_bank,
        applies=lambda layer: layer.enable_moe_block, scaled=_gemma4_scaled),
}


def blocks(model) -> list:
    """`model`'s MoE blocks of a class `ADAPTERS` knows."""
    return [layer for layer in model._flatten_layers(include_self=True)
            if type(layer).__name__ in ADAPTERS and ADAPTERS[type(layer).__name__].applies(layer)]


def top_k(layer) -> int:
    """The experts each token takes in the MoE block `layer` (one of `blocks`)."""
    return ADAPTERS[type(layer).__name__].top_k(layer)


def num_experts(model) -> int:
    """The experts of each MoE block of `model` (0: a dense model)."""
    found = blocks(model)
    return found[0].num_experts if found else 0


def parameters(model) -> Optional[dict]:
    """{total, active, experts, top_k}: `model`'s parameters, and those one token uses (every
    weight but the experts' banks, which count top_k / E of theirs), as MaxText counts an
    MoE's active parameters; None for a dense model."""
    found = blocks(model)
    if not found:
        return None
    total = sum(math.prod(weight.shape) for weight in model.weights)
    banks = sum(math.prod(weight.shape) for layer in found
                for weight in ADAPTERS[type(layer).__name__].bank_layer(layer).weights)
    experts, k = found[0].num_experts, top_k(found[0])
    return {"total": total, "active": total - banks + banks * k // experts, "experts": experts,
            "top_k": k}


def check_capacity(capacity_factor: Optional[float]) -> None:
    """A one-line error for a capacity factor that keeps no token."""
    if capacity_factor is not None and not capacity_factor > 0:
        raise UserError(f"model.moe_capacity_factor={capacity_factor} keeps no token: give a factor "
                        "above 0 (1.25 lets each expert take 1.25x its even share of a batch's "
                        "tokens and drops the rest), or leave it out for dropless experts (every "
                        "token to its top-k experts, as transformers computes them)")


def route_blocks(model, capacity_factor: Optional[float] = None) -> int:
    """Routes each MoE block of `model` through `sparse_call`; returns how many it routed."""
    check_capacity(capacity_factor)
    found = [layer for layer in blocks(model) if not getattr(layer, "_tpu_keras_sparse", False)]
    routers = []  # each layer's router statistics of one forward pass (`load_balancing_loss`)
    for index, layer in enumerate(found):
        # An instance attribute, as `splash_attention` routes attention: keras-hub's call stays
        # the fallback.
        block = ADAPTERS[type(layer).__name__]
        if block.router is None:  # the bank takes keras-hub's router's weights
            bank = block.bank_layer(layer)
            object.__setattr__(bank, "call", functools.partial(
                dispatched, bank.call, block, layer=layer, capacity_factor=capacity_factor or 0.0))
        else:
            object.__setattr__(layer, "call", functools.partial(
                sparse_call, layer.call, block, layer=layer,
                place=(index, len(found), routers), capacity_factor=capacity_factor or 0.0))
        object.__setattr__(layer, "_tpu_keras_sparse", True)
    return len(found)


def check_remat(model, remat: str) -> None:
    """`train.remat='blocks'` runs each block inside `jax.checkpoint`, and the load-balancing
    loss gathers every MoE layer's router statistics of a forward pass across blocks: a
    value that cannot leave its block's checkpoint. Refused together, one line."""
    if remat != "blocks":
        return
    for layer in blocks(model):
        if getattr(layer, "_tpu_keras_sparse", False) and ADAPTERS[type(layer).__name__].coefficient(layer):
            raise UserError("train.remat='blocks' and a mixture of experts' load-balancing loss do "
                            "not go together yet (the loss gathers every block's router statistics, "
                            "and each recomputed block keeps its own): use train.remat='none', or "
                            "train without the loss (model.router_aux_loss_coefficient=0 for "
                            "Qwen3-MoE and Qwen 3.5, model.router_aux_loss_coef=0 for Mixtral; "
                            "gpt-oss's is transformers' 0.9, fixed)")


def unrecorded(model) -> None:
    """Leaves `model`'s MoE blocks out of `recorded_load`: a block recomputed in the backward
    pass (`train.remat='blocks'`) traces inside `jax.checkpoint`, whose values cannot leave it."""
    for layer in blocks(model):
        object.__setattr__(layer, "_tpu_keras_unrecorded", True)


class Load:
    """The experts' load of one forward pass: each MoE layer's tokens per expert (E,), its
    dropped copies, its top k and whether it has a capacity (`recorded_load`)."""

    def __init__(self):
        self.layers = []

    def logs(self) -> dict:
        """{BUSIEST: the largest share of a layer's tokens that one expert took (even: top_k /
        E; 1: every token to one expert), DROPPED: the share of the copies a capacity dropped,
        where one is set}; {} for a pass with no recorded layer."""
        import jax.numpy as jnp
        if not self.layers:
            return {}
        copies = [jnp.maximum(jnp.sum(per_expert), 1).astype(jnp.float32)
                  for per_expert, _, _, _ in self.layers]
        busiest = [jnp.max(per_expert) * top_k / total
                   for (per_expert, _, top_k, _), total in zip(self.layers, copies)]
        logs = {BUSIEST: jnp.max(jnp.stack(busiest))}
        if any(capped for *_, capped in self.layers):
            logs[DROPPED] = sum(dropped for _, dropped, _, _ in self.layers) / sum(copies)
        return logs


_OPEN: list = []  # the `Load`s being recorded, innermost last


@contextlib.contextmanager
def recorded_load():
    """Collects the load of the MoE layers called inside (a train step's forward pass) into
    the `Load` it yields; its values are the traced step's, to return from it."""
    load = Load()
    _OPEN.append(load)
    try:
        yield load
    finally:
        _OPEN.remove(load)


def sparse_call(fallback, block: Block, hidden_states, attention_mask=None, training=None, *, layer,
                place: tuple, capacity_factor: float, **kwargs):
    """The block's call: (output, router logits), as keras-hub's returns them (gpt-oss's
    returns its router's scores, which no caller reads)."""
    import jax.numpy as jnp
    if keras.backend.backend() != "jax":  # what the caller passed, and no more (gpt-oss: nothing)
        given = {"attention_mask": attention_mask, "training": training}
        return fallback(hidden_states, **{k: v for k, v in given.items() if v is not None}, **kwargs)
    # The SavedModel export traces a symbolic batch and length (jax2tf), which the sort into
    # experts' tiles cannot size, and Keras 3.15 infers a functional model's shapes with
    # stand-in sizes (83 and 89 tokens), which a mesh's batch axes do not divide: there every
    # expert runs on every token (`served`), never run for values in the latter.
    symbolic = _symbolic(hidden_states)
    batch, length, hidden = hidden_states.shape
    tokens = jnp.reshape(hidden_states, (-1, hidden))
    logits = block.router(layer)(tokens)
    weights, experts = select(logits, layer.top_k, block.softmax_first, block.normalize(layer),
                              by_sort=symbolic)
    out = _combined(block, layer, tokens, weights, experts, capacity_factor, symbolic)
    if block.shared is not None:
        out = out + block.shared(layer, tokens)
    factor = block.coefficient(layer)  # the backbone's argument (router_aux_loss_coef...)
    if training is None:  # gpt-oss's decoder calls its block without it: the call's own (Keras 3.15)
        training = layer._get_call_context().get_value("training")
    if training and factor:
        index, layers, routers = place
        if index == 0:
            routers.clear()  # a new forward pass
        routers.append(router_statistics(logits, layer.top_k, token_mask(attention_mask, batch * length)))
        if index == layers - 1 and len(routers) == layers:  # the last MoE layer: all of them
            layer.add_loss(factor * load_balancing_loss(routers))
            routers.clear()
    return jnp.reshape(out, (batch, length, hidden)).astype(hidden_states.dtype), logits


def dispatched(fallback, block: Block, tokens, dispatch_weights, *, layer, capacity_factor: float):
    """The call of a bank that keras-hub's own router feeds (Gemma 4's): tokens (T, H) and
    their weights over every expert (T, E), top-k of them non-zero; (T, H) out."""
    import jax.numpy as jnp
    if keras.backend.backend() != "jax":
        return fallback(tokens, dispatch_weights)
    symbolic = _symbolic(tokens)
    weights, experts = _top(jnp.asarray(dispatch_weights, jnp.float32), block.top_k(layer), symbolic)
    return _combined(block, layer, tokens, weights, experts, capacity_factor, symbolic).astype(tokens.dtype)


def _symbolic(hidden_states) -> bool:
    """Whether this trace's shapes are stand-ins (`sparse_call`'s note): every expert then
    runs on every token (`served`)."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope
    return in_symbolic_scope() or not all(isinstance(d, int) for d in hidden_states.shape)


def _combined(block: Block, layer, tokens, weights, experts, capacity_factor: float, symbolic: bool):
    """(T, H): the chosen experts' outputs for `tokens`, weighted; the load recorded."""
    weights = block.scaled(layer, weights, experts).astype(tokens.dtype)
    bank = block.bank(layer, tokens.dtype)
    if symbolic:
        return served(tokens, weights, experts, bank, block.activation, layer.num_experts)
    out, per_expert, dropped = experts_of(tokens, weights, experts, bank, block.activation,
                                          layer.num_experts, capacity_factor)
    if _OPEN and not getattr(layer, "_tpu_keras_unrecorded", False):
        _OPEN[-1].layers.append((per_expert, dropped, block.top_k(layer), bool(capacity_factor)))
    return out


def _top(scores, top_k: int, by_sort: bool):
    """(values, indices) of the `top_k` largest `scores` along the last axis, the lower index
    first among equals; `by_sort`: by a sort (`select`)."""
    import jax
    import jax.numpy as jnp
    if not by_sort:
        values, chosen = jax.lax.top_k(scores, top_k)
        return values, chosen.astype(jnp.int32)
    chosen = jnp.argsort(-scores, axis=-1, stable=True)[..., :top_k]
    return jnp.take_along_axis(scores, chosen, axis=-1), chosen.astype(jnp.int32)


def select(logits, top_k: int, softmax_first: bool, normalize: bool, by_sort: bool = False):
    """(weights, experts), each (tokens, top_k): the router's choice of experts per token.
    `by_sort`: the top k by a sort, for the SavedModel, whose TensorFlow (2.21) reads no
    StableHLO composite, which `jax.lax.top_k` is since jax 0.10."""
    import jax
    import jax.numpy as jnp
    logits = logits.astype(jnp.float32)
    if softmax_first:
        weights, experts = _top(jax.nn.softmax(logits, axis=-1), top_k, by_sort)
        if normalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    else:  # gpt-oss: the top-k logits, then a softmax over them
        weights, experts = _top(logits, top_k, by_sort)
        weights = jax.nn.softmax(weights, axis=-1)
    return weights, experts


def served(tokens, weights, experts, bank: Bank, activation, num_experts: int):
    """(T, H): every expert on every token, each weighted by the router's weight for it (0
    where not chosen): keras-hub's dense bank, for a trace of symbolic shapes. Dropless."""
    import jax
    import jax.numpy as jnp
    combine = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=tokens.dtype) * weights[..., None], axis=1)
    gate = jnp.einsum("th,ehf->etf", tokens, bank.gate)
    up = jnp.einsum("th,ehf->etf", tokens, bank.up)
    if bank.gate_bias is not None:
        gate, up = gate + bank.gate_bias[:, None], up + bank.up_bias[:, None]
    out = jnp.einsum("etf,efh->eth", activation(gate, up), bank.down)
    if bank.down_bias is not None:
        out = out + bank.down_bias[:, None]
    return jnp.einsum("te,eth->th", combine, out)


def token_mask(attention_mask, tokens: int):
    """(tokens,) 1 for a real token, from keras-hub's padding mask (batch, length) or its
    attention mask (batch, length, length); None where there is none."""
    import jax.numpy as jnp
    if attention_mask is None:
        return None
    mask = jnp.asarray(attention_mask)
    if mask.ndim == 3:
        mask = jnp.any(mask, axis=-1)
    return jnp.reshape(mask, (tokens,)).astype(jnp.float32)


def router_statistics(logits, top_k: int, mask=None) -> tuple:
    """One layer's share of `load_balancing_loss`: (top-k choices per expert (k, E), router
    probability per expert (E,), both summed over the real tokens; how many are real)."""
    import jax
    import jax.numpy as jnp
    experts = logits.shape[-1]
    probabilities = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    _, chosen = jax.lax.top_k(probabilities, top_k)
    choices = jax.nn.one_hot(chosen, experts, dtype=jnp.float32)  # (tokens, k, E)
    if mask is None:
        mask = jnp.ones(logits.shape[:1], jnp.float32)
    return (jnp.sum(choices * mask[:, None, None], axis=0), jnp.sum(probabilities * mask[:, None], axis=0),
            jnp.sum(mask))


def load_balancing_loss(routers) -> "jax.Array":
    """transformers' `load_balancing_loss_func` over the layers' `router_statistics`: E x the
    sum over experts of (its share of the top-k choices) x (its mean probability), both over
    every layer's real tokens at once, as transformers concatenates the layers' logits (so
    not the mean of each layer's loss)."""
    import jax.numpy as jnp
    choices, probability, real = (sum(parts) for parts in zip(*routers))
    real = jnp.maximum(real, 1.0)
    return jnp.sum((choices / real) * (probability / real)[None, :]) * choices.shape[-1]


def capacity(capacity_factor: float, tokens: int, top_k: int, experts: int) -> int:
    """Copies each expert keeps of `tokens` (0: all of them, dropless)."""
    return math.ceil(capacity_factor * tokens * top_k / experts) if capacity_factor else 0


_AS_ON_A_TPU: list = []  # the expert axis of each open `traced_as_on_a_tpu`, innermost last


@contextlib.contextmanager
def traced_as_on_a_tpu(expert_axis: int = 1):
    """Traces the layer as one TPU device of an expert axis of `expert_axis` devices runs it,
    with no mesh: the axis's tokens gathered, its own E / expert_axis experts, the grouped
    matmuls as `jax.lax.ragged_dot`. For the planner's trace of a step, whose shapes are
    what it counts (`planning.activations`) and which is never compiled here."""
    _AS_ON_A_TPU.append(expert_axis)
    try:
        yield
    finally:
        _AS_ON_A_TPU.pop()


def experts_of(tokens, weights, experts, bank: Bank, activation, num_experts: int,
               capacity_factor: float = 0.0, tiled: Optional[bool] = None,
               exchange=None):
    """(output (T, H), tokens per expert (E,), dropped copies ()): each token's experts'
    outputs, weighted. On a mesh with an `expert` axis, over `shard_map` (module docstring).
    `exchange`: the ragged all-to-all that carries a dropless layer's copies over the expert
    axis, or False for the gather of the axis's tokens; by default (None)
    `jax.lax.ragged_all_to_all` on a TPU and the gather elsewhere. `gathered_all_to_all`
    computes the TPU's exchange on any device."""
    import jax
    from jax.sharding import PartitionSpec
    distribution = keras.distribution.distribution()
    mesh = distribution.device_mesh.backend_mesh if distribution is not None else None
    if tiled is None and _AS_ON_A_TPU:
        if _AS_ON_A_TPU[-1] > 1:
            return _one_device_of_the_axis(tokens, weights, experts, bank, activation, num_experts,
                                           capacity_factor, _AS_ON_A_TPU[-1])
        tiled = False
    # by the devices the step is compiled for (a TPU's in `plan`, from a CPU)
    device = mesh.devices.flat[0] if mesh is not None else (jax.config.jax_default_device
                                                             or jax.devices()[0])
    on_tpu = getattr(device, "platform", "cpu") == "tpu"
    if tiled is None:
        tiled = not on_tpu
    if exchange is None:
        exchange = jax.lax.ragged_all_to_all if on_tpu else False
    if mesh is None or math.prod(mesh.shape.values()) == 1:
        return _local(tokens, weights, experts, bank, activation=activation, num_experts=num_experts,
                      capacity_factor=capacity_factor, axes=None, tiled=tiled)
    # The tokens, flattened from (batch, length): the batch's axes, then the sequence's.
    batch_axes = tuple(dict.fromkeys(axis for axis in (*BATCH_AXES, EXPERT, CONTEXT) if axis in mesh.shape))
    by_expert = EXPERT if mesh.shape.get(EXPERT, 1) > 1 else None
    units = "model" if mesh.shape.get("model", 1) > 1 else None
    rows = PartitionSpec(batch_axes)
    kernels = Bank(PartitionSpec(by_expert, None, units), PartitionSpec(by_expert, None, units),
                   PartitionSpec(by_expert, units, None),
                   *(PartitionSpec(by_expert, units) if b is not None else None
                     for b in (bank.gate_bias, bank.up_bias)),
                   PartitionSpec(by_expert, None) if bank.down_bias is not None else None)
    body = functools.partial(_local, activation=activation, num_experts=num_experts,
                             capacity_factor=capacity_factor, axes=(by_expert, units, batch_axes),
                             tiled=tiled)
    if by_expert is not None and exchange and not capacity_factor:
        body = functools.partial(_exchanged, activation=activation, num_experts=num_experts,
                                 axes=(by_expert, units, batch_axes), tiled=tiled, exchange=exchange)
    return jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, kernels),
                         out_specs=(rows, PartitionSpec(), PartitionSpec()),
                         check_vma=False)(tokens, weights, experts, bank)


def _one_device_of_the_axis(tokens, weights, experts, bank: Bank, activation, num_experts: int,
                            capacity_factor: float, devices: int):
    """`experts_of` with the shapes one device of an expert axis of `devices` has inside its
    shard_map (`traced_as_on_a_tpu`): every device's tokens (here this one's, repeated), its
    own experts; the output cut back to its own tokens, as the sum back to them does."""
    import jax.numpy as jnp
    gathered = [jnp.concatenate([t] * devices, axis=0) for t in (tokens, weights, experts)]
    held = num_experts // devices
    own = Bank(*(None if part is None else part[:held] for part in bank))
    out, per_expert, dropped = _local(*gathered, own, activation=activation, num_experts=num_experts,
                                      capacity_factor=capacity_factor, axes=None, tiled=False)
    return out[:tokens.shape[0]], per_expert, dropped


def _local(tokens, weights, experts, bank: Bank, *, activation, num_experts: int,
           capacity_factor: float, axes, tiled: bool):
    """One device's share: its tokens (T, H), their choices (T, k), its experts' weights.
    `axes`: (the expert axis, the units' axis, the batch axes) inside a shard_map, else None."""
    import jax
    import jax.numpy as jnp
    by_expert, units, batch_axes = axes or (None, None, None)
    if by_expert is not None:  # every token of the devices along `expert`
        tokens, weights, experts = (jax.lax.all_gather(t, by_expert, axis=0, tiled=True)
                                    for t in (tokens, weights, experts))
    count, top_k = experts.shape
    held = bank.gate.shape[0]  # the experts this device holds
    first = jax.lax.axis_index(by_expert) * held if by_expert is not None else 0
    choices = jnp.reshape(experts, (-1,))
    order = jnp.argsort(choices, stable=True)  # the copies by expert; a batch's earliest first
    per_expert = jnp.bincount(choices, length=num_experts)
    starts = jnp.cumsum(per_expert) - per_expert
    sizes = jax.lax.dynamic_slice(per_expert, (first,), (held,)).astype(jnp.int32)
    # No expert takes a token twice, so no capacity above the tokens keeps more.
    limit = min(capacity(capacity_factor, count, top_k, num_experts), count)
    if limit:
        source, valid, out = _slots(tokens, order, jax.lax.dynamic_slice(starts, (first,), (held,)),
                                    sizes, bank, activation, limit, top_k, units)
        dropped = jnp.sum(jnp.maximum(sizes - limit, 0))
    else:
        source, valid, out = _rows(tokens, order, starts[first], sorted_experts=choices[order] - first,
                                   sizes=sizes, bank=bank, activation=activation, top_k=top_k,
                                   units=units, tiled=tiled)
        dropped = jnp.zeros((), jnp.int32)
    scale = jnp.reshape(weights, (-1,))[source] * valid
    combined = jnp.zeros(tokens.shape, out.dtype).at[source // top_k].add(out * scale[:, None].astype(out.dtype))
    if by_expert is not None:  # back to each token's own device, summed over the experts' devices
        combined = jax.lax.psum_scatter(combined, by_expert, scatter_dimension=0, tiled=True)
        dropped = jax.lax.psum(dropped, by_expert)
    if batch_axes:
        others = tuple(axis for axis in batch_axes if axis != by_expert)
        per_expert = jax.lax.psum(per_expert, others) if others else per_expert
        dropped = jax.lax.psum(dropped, others) if others else dropped
    return combined, per_expert, dropped


def _exchanged(tokens, weights, experts, bank: Bank, *, activation, num_experts: int, axes,
               tiled: bool, exchange: Callable):
    """`_local`'s dropless share by all-to-all: each copy of this device's tokens goes to the
    device of its expert along the axis (`exchange`, ragged_all_to_all's signature, one slice
    per expert), lands among that expert's rows from every device, is multiplied there and
    comes back to be weighted and summed. Static at every copy the axis's devices could send
    to this device's experts, as `_rows`."""
    import jax
    import jax.numpy as jnp
    by_expert, units, batch_axes = axes
    me = jax.lax.axis_index(by_expert)
    count, top_k = experts.shape
    held = bank.gate.shape[0]
    choices = jnp.reshape(experts, (-1,))
    order = jnp.argsort(choices, stable=True)  # my copies by expert
    per_expert = jnp.bincount(choices, length=num_experts)
    counts = jax.lax.all_gather(per_expert, by_expert)  # (device, expert): every device's copies
    starts = jnp.cumsum(counts, axis=1) - counts  # where each device's copies of an expert start
    before = jnp.cumsum(counts, axis=0) - counts  # an expert's copies on the devices before
    totals = jnp.reshape(jnp.sum(counts, axis=0), (-1, held))  # (device, its expert): the rows
    group = jnp.reshape(jnp.cumsum(totals, axis=1) - totals, (-1,))  # an expert's first row there
    own = me * held + jnp.arange(held)  # my experts
    mine = jnp.reshape(counts[:, own], (-1,))  # (device x my expert,): the copies each sends me
    rows = counts.shape[0] * count * top_k
    arrived = exchange(tokens[order // top_k], jnp.zeros((rows, tokens.shape[1]), tokens.dtype),
                       starts[me], per_expert, group + before[me], mine, axis_name=by_expert)
    sizes = totals[me]
    expert = jnp.clip(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows), side="right"), 0, held - 1)
    multiply = lambda x, kernels: grouped_matmul(x, kernels, sizes.astype(jnp.int32), tiled)
    out = _feedforward(arrived, bank, activation, multiply, expert, units)
    # Back: each device's products, from where they arrived to where its copies started.
    back = exchange(out, jnp.zeros((count * top_k, out.shape[1]), out.dtype),
                    jnp.reshape(group[own][None, :] + before[:, own], (-1,)), mine,
                    jnp.reshape(starts[:, own], (-1,)), per_expert, axis_name=by_expert)
    scale = jnp.reshape(weights, (-1,))[order]
    combined = jnp.zeros(tokens.shape, out.dtype).at[order // top_k].add(back * scale[:, None].astype(out.dtype))
    return combined, jax.lax.psum(per_expert, batch_axes), jnp.zeros((), jnp.int32)


def gathered_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                        axis_name):
    """`jax.lax.ragged_all_to_all`'s result, made of all-gathers: what a TPU's collective
    computes, on devices whose compiler has none (XLA:CPU). Every device gathers every
    operand and takes the slices sent to it; for checking `_exchanged` off a TPU."""
    import jax
    import jax.numpy as jnp
    me, devices = jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)
    each = input_offsets.shape[0] // devices  # slices a device sends each device
    everything = jax.lax.all_gather(operand, axis_name)  # (sender, rows, ...)
    start, size, at = (jnp.reshape(jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(v, axis_name),
                                                                  me * each, each, axis=1), (-1,))
                       for v in (input_offsets, send_sizes, output_offsets))  # (sender x slice,)
    row = jnp.arange(output.shape[0])
    inside = (row[None, :] >= at[:, None]) & (row[None, :] < (at + size)[:, None])  # (slice, row)
    piece = jnp.argmax(inside, axis=0)
    source = jnp.clip(start[piece] + row - at[piece], 0, operand.shape[0] - 1)
    taken = everything[piece // each, source]
    return jnp.where(jnp.any(inside, axis=0).reshape((-1,) + (1,) * (output.ndim - 1)), taken, output)


def _rows(tokens, order, offset, *, sorted_experts, sizes, bank: Bank, activation, top_k: int, units,
          tiled: bool):
    """Dropless: every copy of the (gathered) tokens a row, this device's experts' rows first
    (rolled to the start of its first expert's group), multiplied group by group. Static at
    every copy, the most this device's experts could be sent. (copies, mine, output rows)."""
    import jax.numpy as jnp
    held = bank.gate.shape[0]
    order, sorted_experts = (jnp.roll(t, -offset) for t in (order, sorted_experts))
    mine = jnp.arange(order.size) < jnp.sum(sizes)
    multiply = lambda x, kernels: grouped_matmul(x, kernels, sizes, tiled)
    out = _feedforward(tokens[order // top_k], bank, activation, multiply,
                       jnp.clip(sorted_experts, 0, held - 1), units)
    return order, mine, out


def _slots(tokens, order, starts, sizes, bank: Bank, activation, limit: int, top_k: int, units):
    """Under a capacity: each of this device's experts gets `limit` slots, filled with its
    earliest copies, and multiplies them as one batch (GShard's dispatch). The rows are
    this device's experts' capacity, not every copy: on an expert axis of n devices,
    about capacity_factor / n of the dropless rows. (copies, filled, output rows)."""
    import jax.numpy as jnp
    held = bank.gate.shape[0]
    slot = jnp.arange(held * limit)
    expert, rank = slot // limit, slot % limit
    valid = rank < sizes[expert]
    source = order[jnp.clip(starts[expert] + rank, 0, order.size - 1)]

    def each_expert(x, kernels):  # (held * limit, K) x (held, K, N): slot by slot of its expert
        x = jnp.reshape(x, (held, limit, x.shape[-1]))
        return jnp.reshape(jnp.einsum("eck,ekn->ecn", x, kernels), (held * limit, -1))
    out = _feedforward(tokens[source // top_k], bank, activation, each_expert, expert, units)
    return source, valid, out


def _feedforward(rows, bank: Bank, activation, multiply, expert, units):
    """Each row through its expert's gated MLP: `multiply(rows, kernels)` the bank's
    products of `_rows` or `_slots`, `expert` each row's expert (for the biases); the
    units' partial sums added over `model` where they are split over it."""
    import jax
    gate, up = multiply(rows, bank.gate), multiply(rows, bank.up)
    if bank.gate_bias is not None:
        gate, up = gate + bank.gate_bias[expert], up + bank.up_bias[expert]
    out = multiply(activation(gate, up), bank.down)
    if units is not None:  # each device along `model` has a part of the units: the sum
        out = jax.lax.psum(out, units)
    if bank.down_bias is not None:
        out = out + bank.down_bias[expert]
    return out


def grouped_matmul(rows, weights, sizes, tiled: Optional[bool] = None):
    """`rows` (R, K) in groups, group g's `sizes[g]` rows after the earlier groups', each
    times its group's (K, N) of `weights` (G, K, N); rows after the last group give zeros.

    On a TPU, `jax.lax.ragged_dot`, which its compiler runs (and costs) at the rows each
    group has. XLA's CPU and GPU compilers expand it into every group's product over every
    row (k x the dense bank's FLOPs at top-k: measured slower than keras-hub's), so there
    (`tiled`) the rows are cut into tiles of one group each and multiplied tile by tile:
    at most one more tile per group than the rows fill (`_tiles`)."""
    import jax
    if tiled is None:
        tiled = jax.devices()[0].platform != "tpu"
    return _tiled(rows, weights, sizes) if tiled else jax.lax.ragged_dot(rows, weights, sizes)


def _tiles(rows: int, groups: int) -> int:
    """The rows of a tile: a power of two near a quarter of a group's even share, so that
    the tiles a group boundary cuts cost at most about a quarter more than the rows."""
    share = max(rows // (4 * groups), 8)
    return min(1 << (share.bit_length() - 1), max(rows, 1))


def _tiled(rows, weights, sizes):
    """`grouped_matmul` in tiles: tile t holds rows of one group g_t alone (megablox's
    schedule), so it is one (tile, K) x (K, N) product with g_t's weights."""
    import jax.numpy as jnp
    count, features = rows.shape
    groups = weights.shape[0]
    tile = _tiles(count, groups)
    blocks = -(-count // tile)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile
    spans = jnp.where(sizes > 0, (ends + tile - 1) // tile - first, 0)  # tiles of each group
    through = jnp.cumsum(spans)
    t = jnp.arange(blocks + groups)  # enough: a group adds at most one tile to the rows'
    group = jnp.clip(jnp.searchsorted(through, t, side="right"), 0, groups - 1)
    active = t < through[-1]
    block = jnp.clip(jnp.where(active, first[group] + t - (through[group] - spans[group]), 0), 0, blocks - 1)
    padded = jnp.pad(rows, ((0, blocks * tile - count), (0, 0)))
    taken = jnp.reshape(padded, (blocks, tile, features))[block]                  # (T, tile, K)
    index = block[:, None] * tile + jnp.arange(tile)[None, :]                     # (T, tile)
    inside = active[:, None] & (index >= starts[group][:, None]) & (index < ends[group][:, None])
    products = jnp.einsum("tbk,tkn->tbn", taken, weights[group]) * inside[..., None].astype(rows.dtype)
    out = jnp.zeros((blocks * tile, weights.shape[-1]), products.dtype)
    out = out.at[jnp.reshape(index, (-1,))].add(jnp.reshape(products, (-1, weights.shape[-1])))
    return out[:count]
