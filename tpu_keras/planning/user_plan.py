"""`tpu_keras.plan_model`: the plan of `python -m tpu_keras.plan` for a model built in the user's code.

The user gives what a run's config would: a function that builds their
model, its loss and optimizer, their layout rules, the mesh, the TPU slice,
the batch, remat and accumulation. The function
becomes a registered builder for the length of the call, and the plan is
`slice_plan.plan` of the config that names it, so it is the CLI's plan of
that builder, figure for figure, `measure` (the compiler's check) included. What the
planner sets for itself (the dtype policy, a `keras.distribution` when it
measures, the registry entry) is restored before it returns.
"""

# Imported inside functions: Keras (the engine must be selected first: engine.select); NumPy
# (start-up time: not every caller needs it).
import contextlib

from tpu_keras import config as config_lib
from tpu_keras.cluster import engine
from tpu_keras.parallelism import REPLICATE_BELOW, as_rules
from tpu_keras.planning import reports, slice_plan


class Plan(dict):
    """The plan, as `python -m tpu_keras.plan --json` gives it; printed, as the command prints it."""

    def __str__(self) -> str:
        return reports.format_plan(self)


def plan_model(make_model, rules=(), *, loss, tpu: str, mesh: dict, batch: int,
               optimizer="adamw", grad_accum_steps: int = 1, remat: str = "none",
               precision: str = "auto", replicate_below: int = REPLICATE_BELOW, ties=(),
               margin: float = 0.1, measure: bool = False, compiler: str = "auto",
               name: str = "") -> Plan:
    """The memory and communication plan of the model `make_model()` builds, on the slice `tpu`.

    `make_model` takes no arguments and returns the model, uncompiled: it is
    called several times, in Keras scopes that allocate nothing. `loss` is the
    loss it trains with (a `keras.losses` object or name), `optimizer` a
    `keras.optimizers` name or instance (its kind sets the optimizer state). The
    rest are a run's settings: `rules` (`Rule`s, `(pattern, axes)` pairs or a
    `keras.distribution.LayoutMap`), `replicate_below` and `ties` as a builder's
    layout, `mesh` as `mesh`, `batch` (the global batch of one micro-batch),
    `grad_accum_steps`, `remat` and `precision` as `train.*`; `name` (default: the
    function's) names the model in the plan. `measure` compiles the real sharded
    step here and adds the compiler's figures, from `compiler` as `plan --compiler`
    says: 'auto' (the default) is the TPU's own where libtpu is installed (nothing
    allocated); 'cpu' is XLA:CPU, which needs as many devices in this process as the
    slice has (XLA_FLAGS on a CPU).
    """
    engine.select("jax")  # the allocation-free build: a one-line error if Keras runs on tf
    import keras
    from tpu_keras.models import registry
    name = name or getattr(make_model, "__name__", "model")
    config = config_lib.defaults()
    config.engine, config.mesh = "jax", dict(mesh)
    config.model = {"name": name}
    config.layout.rules = tuple((rule.pattern, rule.axes) for rule in as_rules(rules))
    config.layout.replicate_below = replicate_below
    config.train.update(batch_size=batch, grad_accum_steps=grad_accum_steps, remat=remat,
                        precision=precision, optimizer=optimizer if isinstance(optimizer, str)
                        else type(optimizer).__name__.lower())
    config_lib.check(config)
    loss = keras.losses.get(loss)
    builder = registry.Builder(make=make_model, loss=lambda: loss, metrics=lambda: [],
                               headline="loss", ties=lambda kwargs: list(ties))
    with _restored(), _registered(registry.REGISTRY, name, builder):
        return Plan(slice_plan.plan(config, tpu, margin, measure,
                                     slice_plan.resolve_compiler(compiler) if measure else "cpu"))


@contextlib.contextmanager
def _registered(registry: dict, name: str, builder):
    """`registry[name] = builder` within the block; what was there before, after."""
    before = registry.get(name)
    registry[name] = builder
    try:
        yield
    finally:
        if before is None:
            del registry[name]
        else:
            registry[name] = before


@contextlib.contextmanager
def _restored():
    """The dtype policy and the `keras.distribution` as they were, after the block."""
    import keras
    with engine.keras_settings_kept():
        keras.distribution.set_distribution(None)  # the abstract builds place nothing
        yield
