"""Bytes each device sends per training step, from the weights' layout and the model's matmuls.

What a mesh axis costs in communication, for a ring collective over `n`
devices on a tensor of `B` bytes (each device sends this much):
all-gather and reduce-scatter `(n - 1) / n * B`, all-reduce twice that.

- `data` (and `fsdp`, for weights too small to split): every gradient is
  all-reduced over the batch splits once per step.
- `fsdp`: a split weight is all-gathered before the forward pass uses it and
  again for the backward pass (ZeRO-3: the gathered copy is not kept), and
  its gradient is reduce-scattered back to the shards, then all-reduced over
  `data`. Weights and gradients count in the dtype the model uses them in:
  under mixed_bfloat16 a kernel is cast to bf16 where it is read, and XLA's
  SPMD partitioner gathers it and reduces its gradient in bf16 (the traced
  program's casts say which weights; norms stay float32).
- `model`: activations. A matmul that contracts a weight's split dimension
  (row-parallel: attention-out, MLP-down, a vocabulary-split lookup) leaves
  a partial sum that is all-reduced in the forward pass; one that splits a
  free dimension (column-parallel: QKV, MLP-up, the head) needs the
  activation's gradient all-reduced in the backward pass. Which matmul reads
  which weight, and along which dimensions, comes from the model's traced
  program (`weight_uses`), not from names. The softmax of a vocabulary-split
  head also reduces a few numbers per token; those are left out.
- `expert`: a batch split like `data` for every weight it does not split;
  a mixture of experts' experts, split over it, have their gradients
  all-reduced over the other batch axes alone. The tokens a MoE layer
  exchanges along it (`models.moe`) are not counted.

With gradient accumulation every collective runs once per micro-batch.

Several slices (`slices` > 1, joined by the data-center network) extend the
`data` axis across them; weights are never split across slices, so fsdp and
model collectives stay inside a slice. A gradient all-reduce over devices
in several slices runs hierarchically, as XLA does it on TPU multislice
(the compiler generates the data-center-network code): reduce-scatter
inside each slice, all-reduce of each device's shard across the slices,
all-gather inside the slice. Per device, of a `B`-byte gradient reduced
over `k` devices per slice and `S` slices: `2 (k-1)/k B` inside the slice
and `2 (S-1)/S B/k` across slices (`network.hierarchical`); the sum is
the flat ring's `2 (n-1)/n B`. The across-slice part is its own entry,
`gradient_all_reduce_across_slices`.
"""

import dataclasses
import math

import jax

from tpu_keras.planning import activations, network
from tpu_keras.planning.network import ring
from tpu_keras.planning.jaxpr_walk import called_program, is_literal, nbytes


@dataclasses.dataclass(frozen=True)
class WeightUse:
    """A matmul (`dot`) or a table lookup (`lookup`) that reads a weight, at a batch of 1."""

    path: str
    kind: str                  # 'dot' or 'lookup'
    contracted: frozenset      # the weight's dimensions summed over (looked up, for a lookup)
    output_bytes: int          # the result, per example
    input_bytes: int           # the other operand (the activation), per example


def weight_uses(model, loss, itemsizes: dict | None = None) -> list[WeightUse]:
    """Every matmul and lookup that reads a weight, traced on abstract values at batch 1.

    `itemsizes`, if given, gets each cast weight's path -> the bytes per element of
    the narrowest dtype the program casts it to (a kernel read in bf16: 2)."""
    variables = model.trainable_variables + model.non_trainable_variables
    traced = jax.make_jaxpr(activations.loss_function(model, loss))(
        activations.abstract(model.trainable_variables),
        activations.abstract(model.non_trainable_variables),
        *activations.abstract_inputs(model, 1))
    # A weight enters as an input; follow it through casts and transposes to where it is used.
    origins = {var: (v.path, tuple(range(len(v.shape))))
               for var, v in zip(traced.jaxpr.invars, variables)}
    uses: list[WeightUse] = []
    _walk(traced.jaxpr, origins, uses, {} if itemsizes is None else itemsizes)
    return uses


def _walk(jaxpr, origins, uses, itemsizes) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        source = origins.get(eqn.invars[0]) if eqn.invars and not is_literal(eqn.invars[0]) else None
        if name == "convert_element_type" and source:
            size = eqn.outvars[0].aval.dtype.itemsize
            itemsizes[source[0]] = min(size, itemsizes.get(source[0], size))
        if name in ("convert_element_type", "copy", "copy_p") and source:
            origins[eqn.outvars[0]] = source
        elif name == "transpose" and source:
            path, dims = source
            origins[eqn.outvars[0]] = (path, tuple(dims[p] for p in eqn.params["permutation"]))
        elif name == "dot_general":
            contracting = eqn.params["dimension_numbers"][0]
            for side in (0, 1):
                found = origins.get(eqn.invars[side]) if not is_literal(eqn.invars[side]) else None
                if found:
                    path, dims = found
                    other = eqn.invars[1 - side]
                    uses.append(WeightUse(path, "dot", frozenset(dims[c] for c in contracting[side]),
                                          nbytes(eqn.outvars[0]), nbytes(other)))
        elif name == "gather" and source:
            path, dims = source
            looked_up = eqn.params["dimension_numbers"].collapsed_slice_dims
            uses.append(WeightUse(path, "lookup", frozenset(dims[d] for d in looked_up),
                                  nbytes(eqn.outvars[0]), 0))
        inner = called_program(eqn)  # jit, custom_jvp, checkpoint: follow the weight inside
        if inner is not None:
            inner_origins = {inner_var: origins[outer] for inner_var, outer in zip(inner.invars, eqn.invars)
                             if not is_literal(outer) and outer in origins}
            if inner_origins:
                _walk(inner, inner_origins, uses, itemsizes)


def per_step(placements, trainable: set, uses, mesh: dict, batch_per_replica: int,
             grad_accum_steps: int = 1, slices: int = 1, itemsizes: dict | None = None) -> dict:
    """Bytes one device sends in one optimizer update, by collective (a dict, JSON-ready).

    `placements` are the weights' (`parallelism.Placement`), `trainable` the
    paths that get gradients, `uses` the model's `weight_uses`, and
    `batch_per_replica` the examples each batch split holds per micro-batch.
    `mesh` is one slice's (data, fsdp, expert, context, model) and `slices` how many there
    are; `itemsizes` the bytes per element each weight is used in (`weight_uses`). Each
    device along `context` holds part of the same sequences, so a gradient is summed over
    it too (what attention gathers along it is the compiler's to tell, `--measure`).
    """
    data, fsdp, model = mesh["data"], mesh["fsdp"], mesh["model"]
    expert = mesh.get("expert", 1)
    data = data * mesh.get("context", 1)  # the gradients' all-reduce also spans the sequence split
    itemsizes = itemsizes or {}
    gathers = scatters = reductions = across = 0.0
    for p in placements:
        shard = p.bytes_per_device(mesh)
        if p.nbytes and p.path in itemsizes:  # as used: a kernel cast to bf16 moves in bf16
            shard = shard * itemsizes[p.path] * max(1, math.prod(p.shape)) / p.nbytes
        copies = 1 if "expert" in p.axes else expert  # the expert axis's copies of the shard
        if "fsdp" in p.axes:
            gathered = shard * fsdp  # what a layer all-gathers: the weight less its model split
            gathers += 2 * ring(fsdp) * gathered
            if p.path in trainable:
                scatters += ring(fsdp) * gathered
                inside, dcn = network.hierarchical("all-reduce", shard, data * copies, slices)
                reductions, across = reductions + inside, across + dcn
        elif p.path in trainable:
            inside, dcn = network.hierarchical("all-reduce", shard, data * fsdp * copies, slices)
            reductions, across = reductions + inside, across + dcn
    # a device along `context` holds its share of each sequence's tokens, and sends that share
    model_axis = model_axis_bytes(placements, uses, model) * batch_per_replica / mesh.get("context", 1)
    sent = {"fsdp_all_gather": gathers, "fsdp_reduce_scatter": scatters,
            "gradient_all_reduce": reductions, "gradient_all_reduce_across_slices": across,
            "model_all_reduce": model_axis}
    sent = {key: round(value * grad_accum_steps) for key, value in sent.items()}
    sent["total"] = sum(sent.values())
    return sent


def model_axis_bytes(placements, uses, model: int) -> float:
    """Activation bytes one device sends per example over a `model` axis of size `model`."""
    if model == 1:
        return 0.0
    split = {p.path: {d for d, axis in enumerate(p.axes) if axis == "model"} for p in placements}
    sent = 0.0
    for use in uses:
        dims = split.get(use.path)
        if not dims:
            continue
        if dims & use.contracted:      # a partial sum: all-reduce the result, forward
            sent += 2 * ring(model) * use.output_bytes
        elif use.kind == "dot":        # column-parallel: all-reduce the input's gradient, backward
            # (one per matmul: XLA reduces Q's, K's and V's separately, not their sum)
            sent += 2 * ring(model) * use.input_bytes
        else:                          # a lookup split along its rows' width: gather the rows
            sent += ring(model) * use.output_bytes
    return sent
