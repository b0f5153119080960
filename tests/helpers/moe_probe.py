"""The sparse MoE layer (tpu_keras/models/moe.py) against keras-hub's dense bank, transformers'
load-balancing loss and the TPU compiler's cost analysis, in one process on the jax engine.

    python tests/helpers/moe_probe.py

Prints one line, `MOE {json}`:
- `tiled`: the CPU's tiled grouped matmul against `jax.lax.ragged_dot` (outputs and both
  gradients), for group sizes with empty groups and rows left over;
- `blocks`: for each keras-hub MoE block class (Qwen3-MoE, Mixtral, Qwen 3.5's, gpt-oss), the
  largest output difference of the sparse call from keras-hub's own, and of its gradients;
- `aux`: the layer's load-balancing loss against transformers' `load_balancing_loss_func` on
  the same router logits, with and without a padding mask;
- `capacity`: copies dropped under a capacity factor, against a count by hand, and the
  output against the dense bank's over the kept copies, on one device and on fsdp 2 x expert 2;
- `exchange`: dropless by all-to-all (the TPU's `ragged_all_to_all`, computed here by
  `moe.gathered_all_to_all`) on fsdp 2 x expert 2, expert 4 and expert 2 x model 2 (with
  gpt-oss's biases): the output against the dense bank's, the gradients against the gather's;
- `tpu_exchange`: the layer's forward and backward compiled for a TPU v5e-8 (libtpu) on an
  expert axis of 8, by all-to-all (the default there) and by the gather: the collectives and
  the bytes each device sends;
- `flops`: XLA's cost analysis of the forward layer compiled for one TPU v5e chip (libtpu),
  sparse against dense, at 8 experts with top 2.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# Four CPU devices, for the capacity on a mesh of fsdp 2 x expert 2.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from tpu_keras.models import moe  # noqa: E402

HIDDEN, UNITS, EXPERTS, TOP_K, TOKENS = 32, 48, 8, 2, 96
rng = np.random.default_rng(0)


def gap(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(b, "float64"))))


def tiled_against_ragged() -> float:
    worst = 0.0
    for rows, groups in ((37, 4), (512, 8), (100, 32)):
        sizes = rng.multinomial(rows - 5, np.ones(groups) / groups).astype(np.int32)
        sizes[0] = 0  # an empty group; 5 rows after the last one
        sizes = jnp.asarray(sizes)
        x = jnp.asarray(rng.normal(size=(rows, 16)), jnp.float32)
        w = jnp.asarray(rng.normal(size=(groups, 16, 8)) / 4, jnp.float32)
        loss = lambda tiled: lambda x, w: jnp.sum(jnp.sin(moe.grouped_matmul(x, w, sizes, tiled)))
        worst = max(worst, gap(moe.grouped_matmul(x, w, sizes, True), jax.lax.ragged_dot(x, w, sizes)))
        for a, b in zip(jax.grad(loss(True), (0, 1))(x, w), jax.grad(loss(False), (0, 1))(x, w)):
            worst = max(worst, gap(a, b))
    return worst


def made_blocks() -> dict:
    """{class name: a built block of that class}, the tiny sizes, weights drawn again large."""
    from keras_hub.src.models.gpt_oss.gpt_oss_decoder import GptOssSparseMoeBlock
    from keras_hub.src.models.mixtral.mixtral_decoder import MixtralSparseMoeBlock
    from keras_hub.src.models.qwen3_5_moe.qwen3_5_moe_decoder import Qwen3_5MoeSparseMoeBlock
    from keras_hub.src.models.qwen3_moe.qwen3_moe_decoder import Qwen3SparseMoeBlock
    keras.utils.set_random_seed(0)
    made = {
        "Qwen3SparseMoeBlock": Qwen3SparseMoeBlock(HIDDEN, UNITS, EXPERTS, TOP_K, norm_top_k_prob=False,
                                                   router_aux_loss_coefficient=0.001),
        "MixtralSparseMoeBlock": MixtralSparseMoeBlock(HIDDEN, UNITS, EXPERTS, TOP_K, router_aux_loss_coef=0.02),
        "Qwen3_5MoeSparseMoeBlock": Qwen3_5MoeSparseMoeBlock(HIDDEN, UNITS, UNITS, EXPERTS, TOP_K,
                                                             router_aux_loss_coefficient=0.001),
        "GptOssSparseMoeBlock": GptOssSparseMoeBlock(HIDDEN, UNITS, EXPERTS, TOP_K),
    }
    for layer in made.values():
        layer.build((None, None, HIDDEN))
        for variable in layer.weights:
            scale = 1.0 if len(variable.shape) == 1 else 1 / np.sqrt(variable.shape[-2])
            variable.assign(rng.normal(size=variable.shape) * scale)
    return made


def against_dense(layer, x) -> dict:
    """The sparse call's output and gradients against keras-hub's, on the same weights."""
    variables = layer.trainable_variables

    def forward(call):
        def run(values, inputs):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return call(inputs)[0]
        return run

    values = [v.value for v in variables]
    dense = forward(layer.call)
    moe.route_blocks(layer)
    sparse = forward(layer.call)
    loss = lambda run: lambda values, inputs: jnp.sum(jnp.sin(run(values, inputs)))
    grads = [jax.jit(jax.grad(loss(run), (0, 1)))(values, x) for run in (dense, sparse)]
    flat = [jax.tree.leaves(g) for g in grads]
    return {"output": gap(jax.jit(dense)(values, x), jax.jit(sparse)(values, x)),
            "gradients": max(gap(a, b) for a, b in zip(*flat)),
            "scale": float(np.max(np.abs(np.asarray(jax.jit(dense)(values, x)))))}


def aux_against_transformers() -> dict:
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    layers = [rng.normal(size=(2 * 24, EXPERTS)).astype(np.float32) * 2 for _ in range(3)]
    mask = np.ones((2, 24), np.int64)
    mask[1, 17:] = 0
    ours = lambda m: float(moe.load_balancing_loss([moe.router_statistics(jnp.asarray(l), TOP_K, m)
                                                    for l in layers]))
    theirs = lambda m: float(load_balancing_loss_func(tuple(torch.tensor(l) for l in layers), EXPERTS, TOP_K, m))
    return {"unmasked": [ours(None), theirs(None)],
            "masked": [ours(jnp.asarray(mask.reshape(-1), jnp.float32)), theirs(torch.tensor(mask))]}


def kept_by_hand(experts, limit: int, groups: int = 1):
    """(tokens, k) 1 for each copy an expert keeps: in each of `groups` runs of tokens (the
    tokens an expert axis gathers), each expert's first `limit` copies in token order."""
    kept = np.zeros(experts.shape, np.float32)
    for group in np.split(np.arange(len(experts)), groups):
        taken = np.zeros(EXPERTS, int)
        for t in group:
            for j, e in enumerate(experts[t]):
                kept[t, j] = taken[e] < limit
                taken[e] += 1
    return kept


def capacity_drops() -> dict:
    """Copies dropped at factor 1.0 over skewed choices, against the count by hand: expert e
    keeps its first ceil(T k / E) copies in token order; and the output, against the dense
    bank's over the kept copies alone, on one device and on a mesh of fsdp 2 x expert 2
    (whose expert axis gathers half the tokens, so each half has its own capacity)."""
    experts = jnp.asarray(np.stack([rng.choice(4, TOP_K, replace=False, p=[.55, .25, .1, .1])
                                    for _ in range(TOKENS)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.2, 0.8, experts.shape), jnp.float32)
    x = jnp.asarray(rng.normal(size=(TOKENS, HIDDEN)), jnp.float32)
    bank = moe.Bank(*(jnp.asarray(rng.normal(size=s), jnp.float32) / 8 for s in
                      ((EXPERTS, HIDDEN, UNITS), (EXPERTS, HIDDEN, UNITS), (EXPERTS, UNITS, HIDDEN))))
    limit = moe.capacity(1.0, TOKENS, TOP_K, EXPERTS)
    counts = np.bincount(np.asarray(experts).reshape(-1), minlength=EXPERTS)
    out, per_expert, dropped = moe.experts_of(x, weights, experts, bank, moe._silu_glu, EXPERTS, 1.0)
    full, _, none = moe.experts_of(x, weights, experts, bank, moe._silu_glu, EXPERTS)
    kept = lambda groups: kept_by_hand(np.asarray(experts), moe.capacity(1.0, TOKENS // groups, TOP_K,
                                                                          EXPERTS), groups)
    dense = lambda kept: moe.served(x, weights * kept, experts, bank, moe._silu_glu, EXPERTS)
    mesh = keras.distribution.DeviceMesh((2, 2), ("fsdp", "expert"), jax.devices()[:4])
    with keras.distribution.ModelParallel(layout_map=keras.distribution.LayoutMap(mesh),
                                          batch_dim_name="fsdp").scope():
        on_mesh = {factor: jax.jit(lambda *a, f=factor: moe.experts_of(*a, moe._silu_glu, EXPERTS, f))(
            x, weights, experts, bank) for factor in (1.0, 0.0)}
    return {"dropped": int(dropped), "by_hand": int(np.maximum(counts - limit, 0).sum()),
            "dropless_dropped": int(none), "per_expert": [int(c) for c in per_expert],
            "by_hand_per_expert": [int(c) for c in counts],
            "output": gap(out, dense(kept(1))), "dropless_output": gap(full, dense(1.0)),
            "mesh_output": gap(on_mesh[1.0][0], dense(kept(2))),
            "mesh_dropless_output": gap(on_mesh[0.0][0], dense(1.0)),
            "mesh_dropped": int(on_mesh[1.0][2]),
            "mesh_by_hand": int((1 - kept(2)).sum()), "scale": float(np.max(np.abs(np.asarray(full))))}


def exchanged() -> dict:
    """Dropless on three expert meshes, each copy sent to its expert's device and back
    (`_exchanged`): the output against the dense bank, the gradients against the gather's."""
    experts = jnp.asarray(np.stack([rng.choice(EXPERTS, TOP_K, replace=False, p=np.r_[.3, .2, np.full(6, .5 / 6)])
                                    for _ in range(TOKENS)]), jnp.int32)  # uneven: ragged slices
    weights = jnp.asarray(rng.uniform(0.2, 0.8, experts.shape), jnp.float32)
    x = jnp.asarray(rng.normal(size=(TOKENS, HIDDEN)), jnp.float32)
    shapes = ((EXPERTS, HIDDEN, UNITS), (EXPERTS, HIDDEN, UNITS), (EXPERTS, UNITS, HIDDEN),
              (EXPERTS, UNITS), (EXPERTS, UNITS), (EXPERTS, HIDDEN))
    biased = moe.Bank(*(jnp.asarray(rng.normal(size=s), jnp.float32) / 8 for s in shapes))
    plain = moe.Bank(*biased[:3])

    def step(exchange):
        def loss(x, weights, bank):
            out, per_expert, _ = moe.experts_of(x, weights, experts, bank, moe._silu_glu, EXPERTS,
                                                exchange=exchange)
            return jnp.sum(jnp.sin(out)), (out, per_expert)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    result = {}
    for names, shape, bank in ((("fsdp", "expert"), (2, 2), plain), (("expert",), (4,), plain),
                               (("expert", "model"), (2, 2), biased)):
        mesh = keras.distribution.DeviceMesh(shape, names, jax.devices()[:4])
        with keras.distribution.ModelParallel(layout_map=keras.distribution.LayoutMap(mesh),
                                              batch_dim_name=names[0]).scope():
            (_, (out, per_expert)), grads = step(moe.gathered_all_to_all)(x, weights, bank)
            _, gathered = step(False)(x, weights, bank)
        dense = moe.served(x, weights, experts, bank, moe._silu_glu, EXPERTS)
        result[" x ".join(f"{n} {s}" for n, s in zip(names, shape))] = {
            "output": gap(out, dense), "scale": float(np.max(np.abs(np.asarray(dense)))),
            "gradients": max(gap(a, b) / max(float(np.max(np.abs(np.asarray(b)))), 1e-6)
                             for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(gathered))),
            "per_expert": [int(c) for c in per_expert],
            "by_hand_per_expert": [int(c) for c in np.bincount(np.asarray(experts).reshape(-1), minlength=EXPERTS)]}
    return result


def tpu_exchange() -> dict:
    """The layer's forward and backward (E=8, k=2) compiled for a TPU v5e-8 on an expert axis
    of 8: by all-to-all (the default on a TPU) and by the gather, each device's collectives."""
    from tpu_keras.cluster import libtpu
    from tpu_keras.planning import compiled_traffic
    hidden, units, tokens = 512, 1024, 8 * 512
    mesh = keras.distribution.DeviceMesh((8,), ("expert",), libtpu.devices("v5litepod-8"))
    split = jax.sharding.NamedSharding(mesh.backend_mesh, jax.sharding.PartitionSpec("expert"))
    arrays = (jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16, sharding=split),
              jax.ShapeDtypeStruct((tokens, TOP_K), jnp.float32, sharding=split),
              jax.ShapeDtypeStruct((tokens, TOP_K), jnp.int32, sharding=split),
              moe.Bank(*(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=split) for s in
                         ((8, hidden, units), (8, hidden, units), (8, units, hidden)))))

    def gradients(exchange):
        def loss(x, weights, experts, bank):
            out = moe.experts_of(x, weights, experts, bank, moe._silu_glu, 8, exchange=exchange)[0]
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 3))

    found = {}
    with keras.distribution.ModelParallel(layout_map=keras.distribution.LayoutMap(mesh),
                                          batch_dim_name="expert").scope():
        for name, exchange in (("all_to_all", None), ("gather", False)):
            text = jax.jit(gradients(exchange)).lower(*arrays).compile().as_text()
            found[name] = {"ragged_all_to_all": text.count("ragged-all-to-all("),
                           "sent": compiled_traffic.sent_per_device(text, 8)}
    return found


def tpu_flops() -> dict:
    """The forward Qwen3-MoE layer (E=8, k=2), keras-hub's dense bank and the sparse one,
    compiled for one TPU v5e chip: XLA's FLOPs of each."""
    from keras_hub.src.models.qwen3_moe.qwen3_moe_decoder import Qwen3SparseMoeBlock
    from tpu_keras.cluster import libtpu
    chip = jax.sharding.Mesh(np.array(libtpu.devices("v5litepod-8")[:1]), ("one",))
    whole = jax.sharding.NamedSharding(chip, jax.sharding.PartitionSpec())
    layer = Qwen3SparseMoeBlock(1024, 2048, 8, 2, norm_top_k_prob=True)
    layer.build((None, None, 1024))
    variables = layer.trainable_variables
    shapes = [jax.ShapeDtypeStruct(v.shape, jnp.bfloat16, sharding=whole) for v in variables]
    tokens = jax.ShapeDtypeStruct((1, 4096, 1024), jnp.bfloat16, sharding=whole)

    def forward(call):
        def run(values, inputs):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return call(inputs)[0]
        return run

    dense = forward(layer.call)
    moe.route_blocks(layer)
    with jax.default_device(chip.devices.flat[0]):
        flops = {name: jax.jit(run).lower(shapes, tokens).compile().cost_analysis().get("flops")
                 for name, run in (("dense", dense), ("sparse", forward(layer.call)))}
    return {**flops, "ratio": flops["sparse"] / flops["dense"], "top_k_over_experts": 2 / 8}


x = jnp.asarray(rng.normal(size=(2, TOKENS // 2, HIDDEN)), jnp.float32)
result = {"tiled": tiled_against_ragged(),
          "blocks": {name: against_dense(layer, x) for name, layer in made_blocks().items()},
          "aux": aux_against_transformers(), "capacity": capacity_drops(), "exchange": exchanged()}
if "--no-tpu" not in sys.argv:
    result["flops"] = tpu_flops()
    result["tpu_exchange"] = tpu_exchange()
print("MOE " + json.dumps(result), flush=True)
