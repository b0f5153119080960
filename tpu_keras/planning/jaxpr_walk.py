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
