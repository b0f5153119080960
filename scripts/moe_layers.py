"""keras-hub's dense expert bank against the toolkit's sparse MoE layer, side by side.

    python scripts/moe_layers.py [--tokens=4096] [--rounds=4]   (benchmark.py --moe runs it)

One keras-hub Qwen3-MoE block (`Qwen3SparseMoeBlock`: router, experts of gate
and up fused, output) at 8 experts with top 2 and at 32 with top 4, on the
jax engine: a training step of the block alone (its output's and the
load-balancing loss's gradients with respect to its weights and its input,
jitted), computed by keras-hub's dense bank (every expert on every token) and
by `tpu_keras.models.moe` (grouped matmuls of each expert's own tokens), from
the same weights and tokens. The two take turns (benchmark_timing.race), and
each reports its median step time. Beside each, XLA's cost analysis of the
forward layer compiled for this CPU and for one TPU v5e chip by libtpu (no
chip needed): the FLOPs the sparse layer costs against the dense one, which
the TPU compiler counts at the rows each expert has. Prints JSON; quote the
ratios (`sparse_over_dense`).
"""

import json
import os
import statistics
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

import benchmark_timing as timing  # noqa: E402  (beside this script)

_TOKENS = flags.DEFINE_integer("tokens", 4096, "Tokens per step (batch x length).")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "The block's hidden size.")
_UNITS = flags.DEFINE_integer("units", 512, "Each expert's units.")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "Turns each layer gets (an even number).")
_SECONDS = flags.DEFINE_float("seconds", 3.0, "Time spent measuring each turn.")
SIZES = ((8, 2), (32, 4))  # (experts, top_k)


def block(experts: int, top_k: int, hidden: int, units: int):
    """A built keras-hub Qwen3-MoE block with weights drawn from one seed."""
    import keras
    from keras_hub.src.models.qwen3_moe.qwen3_moe_decoder import Qwen3SparseMoeBlock
    keras.utils.set_random_seed(0)
    layer = Qwen3SparseMoeBlock(hidden_dim=hidden, moe_intermediate_dim=units, num_experts=experts,
                                top_k=top_k, norm_top_k_prob=True, router_aux_loss_coefficient=0.001)
    layer.build((None, None, hidden))
    return layer


def step_functions(layer, tokens: int):
    """(dense step, sparse step, forward of each, its arguments): jitted functions of the
    block's weights and input, with keras-hub's call and with the toolkit's."""
    import jax
    import jax.numpy as jnp
    import keras
    from tpu_keras.models import moe
    x = jax.random.normal(jax.random.key(1), (1, tokens, layer.hidden_dim), jnp.float32)
    weights = [v.value for v in layer.trainable_variables]
    dense_call, routed = layer.call, None

    def forward(call, values, inputs):
        with keras.StatelessScope(state_mapping=list(zip(layer.trainable_variables, values)),
                              collect_losses=True) as scope:
            out, _ = call(inputs, training=True)
            losses = sum(scope.losses) if scope.losses else 0.0
        return jnp.sum(out.astype(jnp.float32) ** 2) + losses, out

    moe.route_blocks(layer)
    routed = layer.call
    made = {}
    for name, call in (("dense", dense_call), ("sparse", routed)):
        loss = lambda values, inputs, call=call: forward(call, values, inputs)[0]
        made[name] = (jax.jit(jax.grad(loss, argnums=(0, 1))),
                      jax.jit(lambda values, inputs, call=call: forward(call, values, inputs)[1]))
    return made, (weights, x)


def tpu_flops(layer, tokens: int) -> dict:
    """The forward layer's FLOPs by XLA's cost analysis, compiled for one TPU v5e chip."""
    import jax
    import jax.numpy as jnp
    from tpu_keras.models import moe
    whole = timing.one_tpu_chip()
    shaped = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole)
    weights = [shaped(v.value) for v in layer.trainable_variables]
    x = jax.ShapeDtypeStruct((tokens, layer.hidden_dim), jnp.bfloat16, sharding=whole)
    variables = layer.trainable_variables

    def dense(values, inputs):  # keras-hub's bank and its weighting, as its call computes them
        router, gate_up, down = (values[[v.path for v in variables].index(p)] for p in (
            layer._sparse_feedforward_gate_dense.kernel.path,
            layer.expert_bank._expert_feedforward_gate_dense.path,
            layer.expert_bank._expert_feedforward_output_dense.path))
        logits = inputs @ router.astype(inputs.dtype)
        weights, chosen = moe.select(logits, layer.top_k, True, True)
        routing = jnp.sum(jax.nn.one_hot(chosen, layer.num_experts) * weights[..., None], axis=1)
        both = jnp.einsum("th,ehm->etm", inputs, gate_up.astype(inputs.dtype))
        gate, up = jnp.split(both, 2, axis=-1)
        units = moe._silu_glu(gate, up)
        out = jnp.einsum("etm,emh->eth", units, down.astype(inputs.dtype))
        return jnp.sum(out * routing.T[:, :, None].astype(out.dtype), axis=0)

    def sparse(values, inputs):
        router, gate_up, down = (values[[v.path for v in variables].index(p)] for p in (
            layer._sparse_feedforward_gate_dense.kernel.path,
            layer.expert_bank._expert_feedforward_gate_dense.path,
            layer.expert_bank._expert_feedforward_output_dense.path))
        logits = inputs @ router.astype(inputs.dtype)
        weights, chosen = moe.select(logits, layer.top_k, True, True)
        half = gate_up.shape[-1] // 2
        bank = moe.Bank(gate_up[..., :half].astype(inputs.dtype), gate_up[..., half:].astype(inputs.dtype),
                        down.astype(inputs.dtype))
        return moe.experts_of(inputs, weights.astype(inputs.dtype), chosen, bank, moe._silu_glu,
                              layer.num_experts, tiled=False)[0]  # as on a TPU: ragged_dot

    flops = {name: jax.jit(f).lower(weights, x).compile().cost_analysis().get("flops")
             for name, f in (("dense", dense), ("sparse", sparse))}
    return {**flops, "sparse_over_dense": flops["sparse"] / flops["dense"]}


def measure(experts: int, top_k: int) -> dict:
    layer = block(experts, top_k, _HIDDEN.value, _UNITS.value)
    made, arguments = step_functions(layer, _TOKENS.value)
    outputs = {name: made[name][1](*arguments) for name in made}
    import numpy as np
    gap = float(np.max(np.abs(np.asarray(outputs["dense"]) - np.asarray(outputs["sparse"]))))
    rates = timing.race({name: (lambda name=name: 1.0 / timing.median_seconds(made[name][0], arguments,
                                                                          _SECONDS.value))
                         for name in made}, _ROUNDS.value)
    step = {name: 1.0 / statistics.median(rates[name]) for name in made}
    cpu_flops = {name: made[name][1].lower(*arguments).compile().cost_analysis().get("flops")
                 for name in made}
    return {"experts": experts, "top_k": top_k, "tokens": _TOKENS.value, "hidden": _HIDDEN.value,
            "units": _UNITS.value, "step_seconds": step,
            "sparse_over_dense": step["sparse"] / step["dense"],
            "largest_output_difference": gap,
            "cpu_forward_flops": cpu_flops,
            "tpu_v5e_forward_flops": tpu_flops(layer, _TOKENS.value),
            "ideal_flops_ratio": top_k / experts}


def main(argv):
    del argv
    import jax
    results = [measure(experts, top_k) for experts, top_k in SIZES]
    print(json.dumps({"device": jax.devices()[0].device_kind, "results": results}, indent=2))


if __name__ == "__main__":
    app.run(main)
