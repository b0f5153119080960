"""`with cluster.layout(rules):` a model built in the user's own code, laid out as a run lays one out.

A run sets its model's distribution once per process, from the builder's
rules (`training.setup.build_model`). User code may build several models with
different rules in one process, so here the distribution is a scope: on the
jax engine, entering it makes Keras's distribution one whose every decision
comes from a `Placer` over the cluster's mesh, and leaving it restores the
one it replaced (Keras's own `Distribution.scope()`), so no rule outlives
its block. Each weight Keras creates inside is placed and checked as it is
created, before any memory is allocated for it: the same one-line
`UserError`s as a run. On leaving, the rules that matched no weight and the
ties are checked over the weights made inside.

On the tf engine the cluster has a data axis alone (`connect` refuses the
others with the run's one line), so every weight is replicated; the scope
is the strategy's, and `check(model)` checks the rules against a built model.
"""

# Imported inside functions: Keras (the engine must be selected first: engine.select).
import contextlib

from tpu_keras.errors import UserError
from tpu_keras.parallelism.rules import REPLICATE_BELOW, Placement, Placer, as_rules


class LayoutScope:
    """Lays out the weights Keras creates inside `with` by `rules` over `cluster.mesh`.

    `rules` are `Rule`s, `(pattern, axes)` pairs, or a `keras.distribution.LayoutMap`;
    `replicate_below` and `ties` mean what `layout.replicate_below` and a builder's
    ties mean to a run. Enter it around building and compiling the model; `fit`
    may run inside or after it.
    """

    def __init__(self, cluster, rules=(), replicate_below: int = REPLICATE_BELOW, ties=()):
        self.cluster = cluster
        self.placer = Placer(as_rules(rules), cluster.mesh, replicate_below, ties)
        self._scopes = contextlib.ExitStack()

    def __enter__(self) -> "LayoutScope":
        self._scopes.enter_context(self.cluster.scope())
        if self.cluster.engine == "jax":
            from tpu_keras.parallelism import distribution
            self._scopes.enter_context(distribution.placed(self.cluster, self.placer).scope())
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        self._scopes.__exit__(kind, error, traceback)  # the previous distribution, back
        if error is None and self.cluster.engine == "jax":
            self.check()
        if isinstance(error, UserError):
            # Raised again here, so the user sees their own `with` line and the message,
            # not the frames of the Keras layer that was creating the weight.
            raise error.with_traceback(None) from None
        return False

    def check(self, model=None) -> list[Placement]:
        """Where each weight lives, checked as a run checks them: `model`'s weights, or
        (None) those created in the scope so far on the jax engine."""
        return self.placer.check(model.weights if model is not None else None)
