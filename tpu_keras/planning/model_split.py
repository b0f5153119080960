"""Which values of a traced step the `model` axis splits: tensor parallelism followed through a jaxpr.

Activations live split over `model` between a column-parallel matmul (its
weight split on an output dimension: QKV, MLP-up) and the row-parallel
matmul that contracts the split dimension (attention-out, MLP-down), where
an all-reduce makes them whole again. So the per-head attention scores and
the MLP's wide hidden layer are split; the residual stream is not. XLA's
sharding propagation decides this for the compiled step; `split_dims`
follows the same logic on the traced program, forward from the weights'
layout, so the memory plan can count a split activation once per shard.

Each value gets the dimension split over `model`, or None. The rules:
a matmul keeps an operand's split on a batch or free dimension and loses
it on a contracted one; transposes, reshapes, broadcasts and reductions
move the dimension; an elementwise op is split where its split activation
operands agree (a whole operand, such as a mask, is sliced for free; a
weight, such as a bias, follows the activation); anything else counts as
whole. Where unsure, whole: the estimate errs high.
"""

import math

from tpu_keras.planning.jaxpr_walk import called_program, is_literal

_STRUCTURAL = ("convert_element_type", "copy", "copy_p", "reduce_precision")


def split_dims(jaxpr, inputs: list) -> dict:
    """var -> split dimension (or None) for every value of `jaxpr`; `inputs[i]` is the
    split dimension of its i-th input, or None."""
    split, weights = {}, set()
    for var, dim in zip(jaxpr.invars, inputs):
        split[var] = dim
        if dim is not None:
            weights.add(var)
    _walk(jaxpr, split, weights)
    return split


def _walk(jaxpr, split, weights) -> None:
    for eqn in jaxpr.eqns:
        ins = [None if is_literal(v) else split.get(v) for v in eqn.invars]
        from_weight = [not is_literal(v) and v in weights for v in eqn.invars]
        outs = _inner(eqn, ins, from_weight)
        if outs is None:
            outs = [_rule(eqn, ins, from_weight)] + [None] * (len(eqn.outvars) - 1)
            if eqn.primitive.name in _STRUCTURAL + ("transpose", "reshape", "broadcast_in_dim") \
                    and from_weight[0]:
                weights.add(eqn.outvars[0])
        for var, dim in zip(eqn.outvars, outs):
            split[var] = dim


def _inner(eqn, ins, from_weight):
    """Follows the split into a nested jaxpr (jit, custom_jvp, checkpoint) and back out."""
    inner = called_program(eqn)
    if inner is None:
        return None
    split = dict(zip(inner.invars, ins))
    weights = {v for v, w in zip(inner.invars, from_weight) if w}
    _walk(inner, split, weights)
    return [None if is_literal(v) else split.get(v) for v in inner.outvars]


def _rule(eqn, ins, from_weight):
    name, params = eqn.primitive.name, eqn.params
    out = eqn.outvars[0].aval
    first = ins[0] if ins else None
    if name == "dot_general":
        (contracting, batch) = params["dimension_numbers"]
        found = []
        for side in (0, 1):
            dim = ins[side]
            if dim is None:
                continue
            if dim in contracting[side]:
                return None  # a partial sum, all-reduced whole
            rank = len(eqn.invars[side].aval.shape)
            if dim in batch[side]:
                found.append(batch[side].index(dim))
            else:
                free = [d for d in range(rank) if d not in contracting[side] and d not in batch[side]]
                offset = len(batch[0]) + (0 if side == 0 else _free_count(eqn, 0))
                found.append(offset + free.index(dim))
        return found[0] if found and len(set(found)) == 1 else None
    moves_one_input = name in _STRUCTURAL + ("transpose", "reshape", "broadcast_in_dim", "squeeze",
                                             "argmax", "argmin") or name.startswith("reduce_")
    if moves_one_input and first is None:
        return None
    if name in _STRUCTURAL:
        return first
    if name == "transpose":
        return list(params["permutation"]).index(first)
    if name == "broadcast_in_dim":
        return params["broadcast_dimensions"][first]
    if name == "reshape":
        return _reshaped(eqn.invars[0].aval.shape, out.shape, first)
    if name.startswith("reduce_") or name in ("argmax", "argmin"):
        axes = params.get("axes", ())
        return None if first in axes else first - sum(a < first for a in axes)
    if name == "squeeze":
        dims = params["dimensions"]
        return None if first in dims else first - sum(d < first for d in dims)
    # Elementwise (inputs of the output's shape, or broadcast to it along dimensions of
    # size 1, or scalars): the activations' split, if they agree; weights follow it.
    operands = [(i, v.aval.shape) for i, v in enumerate(eqn.invars) if not is_literal(v)]
    if not all(shape == () or _broadcasts(shape, out.shape) for _, shape in operands):
        return None  # not elementwise (concatenate, gather, pad, ...): whole
    dims = {ins[i] for i, shape in operands if shape != () and not from_weight[i]
            and ins[i] is not None and shape[ins[i]] == out.shape[ins[i]]}
    return dims.pop() if len(dims) == 1 else None


def _broadcasts(shape, to) -> bool:
    return len(shape) == len(to) and all(n in (1, m) for n, m in zip(shape, to))


def _free_count(eqn, side: int) -> int:
    (contracting, batch) = eqn.params["dimension_numbers"]
    return len(eqn.invars[side].aval.shape) - len(contracting[side]) - len(batch[side])


def _reshaped(before, after, dim):
    """Where dimension `dim` of shape `before` lands in `after`: the output dimension that
    starts at the same offset (so (b, s, h*k) -> (b, s, h, k) keeps a split on h)."""
    offset = math.prod(before[:dim])
    for j in range(len(after)):
        if math.prod(after[:j]) == offset and after[j] > 1:
            if after[j] % before[dim] == 0 or before[dim] % after[j] == 0:
                return j
            return None
    return None
