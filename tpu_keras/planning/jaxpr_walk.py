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
    `custom_jvp` and `checkpoint` equations call laid open: a value passed into or out
    of a called program is the value outside it (`resolve`)."""

    def __init__(self, jaxpr):
        self.inputs = set(jaxpr.invars)
        self._alias, self._made = {}, {}
        self._constant = {}
        self._walk(jaxpr)

    def _walk(self, jaxpr) -> None:
        for eqn in jaxpr.eqns:
            inner = called_program(eqn)
            if inner is None:
                operands = [v for v in eqn.invars if not is_literal(v)]
                for var in eqn.outvars:
                    self._made[var] = (eqn.primitive.name, operands)
                continue
            self._alias.update((a, b) for a, b in zip(inner.invars, eqn.invars) if not is_literal(b))
            self._walk(inner)
            self._alias.update((a, b) for a, b in zip(eqn.outvars, inner.outvars) if not is_literal(b))

    def resolve(self, var):
        while var in self._alias:
            var = self._alias[var]
        return var

    def made_by(self, var):
        """(primitive name, the non-constant-literal operands, resolved) of `var`, or None for
        an input of the step."""
        made = self._made.get(self.resolve(var))
        return made and (made[0], [self.resolve(v) for v in made[1]])

    def is_constant(self, var) -> bool:
        """Computed from no input of the step (a mask from `iota`, a filled array): the
        compiler makes it where it is used and keeps no buffer for it."""
        var = self.resolve(var)
        if var not in self._constant:
            made = self.made_by(var)
            self._constant[var] = made is not None and made[0] not in _RANDOM and all(
                self.is_constant(v) for v in made[1])
        return self._constant[var]

    def unbroadcast_size(self, var) -> int:
        """Elements of `var` before a broadcast made it: what a fused consumer reads."""
        var = self.resolve(var)
        made = self.made_by(var)
        while made and made[0] == "broadcast_in_dim" and made[1]:
            var = made[1][0]
            made = self.made_by(var)
        return math.prod(var.aval.shape)


_RANDOM = ("random_bits", "random_seed", "random_wrap", "random_unwrap", "rng_bit_generator",
           "rng_uniform", "threefry2x32")
