"""What walking a traced step (a jaxpr) needs: which values are constants, their bytes,
and the program a call equation runs.

Both the communication count and the model-axis split follow weights through
the traced step, into the programs that `jit`, `custom_jvp` and `checkpoint`
equations call; this is the one place that knows how those look.
"""

import math

from jax.extend.core import Literal


def is_literal(var) -> bool:
    """A constant written into the program: no value to follow."""
    return isinstance(var, Literal)


def nbytes(var) -> int:
    return math.prod(var.aval.shape) * var.aval.dtype.itemsize


def called_program(eqn):
    """The jaxpr `eqn` runs (jit, custom_jvp, checkpoint), when its inputs and outputs
    are the equation's own, one for one; else None."""
    for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars) \
                and len(inner.outvars) == len(eqn.outvars):
            return inner
    return None


class Producers:
    """Which equation made each value of a traced step, with the programs that `jit`,
    `custom_jvp` and `checkpoint` equations call laid open.

    A value is `(call, var)`: JAX shares one traced program among the calls of a
    function with the same shapes (every layer's `gelu`), so an inner variable is a
    different value in each call. A value passed into or out of a called program is
    the value outside it (`value` and `made_by` resolve it). Which values are
    constants is settled in the same pass, since a jaxpr lists each equation after its
    operands'.
    """

    def __init__(self, jaxpr):
        self._alias, self._made, self._constant, self._calls = {}, {}, set(), 0
        self.inputs = {(0, v) for v in jaxpr.invars}
        self._walk(jaxpr, 0)

    def _walk(self, jaxpr, call: int) -> None:
        for eqn in jaxpr.eqns:
            inner = called_program(eqn)
            if inner is None:
                operands = [self._resolve((call, v)) for v in eqn.invars if not is_literal(v)]
                constant = eqn.primitive.name not in _RANDOM and all(v in self._constant for v in operands)
                for var in eqn.outvars:
                    self._made[call, var] = (eqn.primitive.name, operands)
                    if constant:
                        self._constant.add((call, var))
                continue
            self._calls += 1
            inside = self._calls
            self._alias.update(((inside, a), self._resolve((call, b)))
                               for a, b in zip(inner.invars, eqn.invars) if not is_literal(b))
            self._walk(inner, inside)
            self._alias.update(((call, a), (inside, b))
                               for a, b in zip(eqn.outvars, inner.outvars) if not is_literal(b))

    def _resolve(self, value):
        while value in self._alias:
            value = self._alias[value]
        return value

    def value(self, var):
        """The value a variable of the traced step (not of a called program) is."""
        return self._resolve((0, var))

    def made_by(self, value):
        """(primitive name, the values it read, literals left out) of `value`, or None for an
        input of the step."""
        return self._made.get(value)

    def is_constant(self, value) -> bool:
        """Computed from no input of the step (a mask from `iota`, a filled array): the
        compiler makes it where it is used and keeps no buffer for it."""
        return value in self._constant

    def unbroadcast_size(self, value) -> int:
        """Elements of `value` before a broadcast made it: what a fused consumer reads."""
        made = self.made_by(value)
        while made and made[0] == "broadcast_in_dim" and made[1]:
            value = made[1][0]
            made = self.made_by(value)
        return math.prod(aval(value).shape)


def aval(value):
    """The shape and dtype of a `Producers` value."""
    return value[1].aval


_RANDOM = ("random_bits", "random_seed", "random_wrap", "random_unwrap", "rng_bit_generator",
           "rng_uniform", "threefry2x32")
