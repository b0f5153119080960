"""XLA's own figures for the real sharded training step: the plan's check.

`python -m tpu_keras.plan --measure` builds the config's model as a run
does (the jax cluster on as many fake CPU devices as the slice has, the
layout rules' distribution, the compiled model with the toolkit's step),
compiles one training step for the plan's batch, and reads the compiled
program's `memory_analysis()`: what one device holds for the step's
arguments (weights, optimizer state, the batch), its outputs less those
written over a donated argument, and its temporaries (gradients,
activations, XLA's workspace). Compiling the step at twice the batch too
gives the activations alone: the temporaries that grow with the batch.
The compiled program's collectives give the bytes each device sends
(`planning.compiled_traffic`), beside the plan's. With several slices, the
fake devices are grouped into slices as a multislice run lays them out
(contiguous blocks, the slice outermost in the data axis), and each
collective whose groups span slices counts what crosses them apart.

On CPU, XLA widens bf16 collectives to float32 (its all-reduce-promotion
and float-normalization-bf16 passes: the CPU runtime cannot reduce bf16),
which a TPU does not; so on CPU the bytes are read from the program right
after SPMD partitioning (the partitioner's collectives, in the dtypes it
chose, before any backend pass), and the CPU's own figure is kept beside
them. On CPU, memory compares best in float32: with bf16, CPU XLA keeps
float32 copies a TPU does not. On a TPU VM the same command gives the TPU
compiler's figures.
"""

# Imported inside functions: Keras (the engine must be selected first: engine.select); JAX
# (optional: absent on a plain install; the tf engine runs without JAX); NumPy (start-up
# time: not every caller needs it).
import copy
import glob
import math
import os
import tempfile

from tpu_keras import cluster as cluster_lib
from tpu_keras.cluster import engine
from tpu_keras.errors import UserError
from tpu_keras.parallelism.mesh import batch_splits
from tpu_keras.training import setup


def measure(config, mesh: dict, batch_per_replica: int, state_bytes: int = 0,
            slices: int = 1) -> dict:
    """XLA's bytes per device for one step of `config` on `mesh` (one slice's) times
    `slices` at `batch_per_replica`.

    The model is really built, so on CPU its weights and optimizer state
    (`state_bytes` in all) must fit this machine's memory.
    """
    import jax
    mesh = {**mesh, "data": mesh["data"] * slices}  # the slices outermost in data
    devices = math.prod(mesh.values())
    if jax.device_count() != devices:
        raise UserError(f"--measure needs {devices} devices for mesh {mesh}, and JAX has "
                        f"{jax.device_count()}; run it in a fresh process")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if jax.default_backend() == "cpu" and state_bytes > memory / 2:
        raise UserError(f"--measure builds the model here: its weights and optimizer state "
                        f"({state_bytes / 2**30:.1f} GiB) would not fit this machine's "
                        f"{memory / 2**30:.0f} GiB; measure a smaller variant of the config "
                        "(the plan's accuracy does not depend on the size), or run it on the TPU VM")
    config = copy.deepcopy(config)
    config.engine, config.cluster.virtual_devices = "jax", devices
    config.mesh = dict(mesh)
    config.train.steps_per_execution = 1
    with engine.keras_settings_kept():
        model = _built(config)
        at_batch = _analysis(model, config, batch_per_replica, slices)
        at_twice = _analysis(model, config, 2 * batch_per_replica, slices, collectives=False)
    return {**at_batch, "activations": at_twice["temporaries"] - at_batch["temporaries"],
            "backend": jax.default_backend(), "devices": devices, "slices": slices}


def _built(config):
    """The model compiled as the run compiles it, wrapped as its objective wraps it (GRPO's
    group model, whose step, the policy's pass, the reference's and the clipped loss, is
    what a GRPO run compiles)."""
    from tpu_keras import models, objectives
    cluster = cluster_lib.connect(config.cluster, engine="jax", mesh=config.mesh)
    objective = objectives.of(config)
    if not objective.plans_its_wrapper:
        objective = objectives.Objective()  # the language model's own step
    builder = objective.builder(models.registry.get(config.model)[0], config)
    return setup.build_model(config, cluster, builder, objective=objective)


def _analysis(model, config, batch_per_replica: int, slices: int = 1,
              collectives: bool = True) -> dict:
    """The compiled step's memory per device, by kind, and their sum at the step's peak."""
    import jax
    import keras
    from tpu_keras.planning import activations, compiled_traffic

    rows = batch_per_replica * batch_splits(config.mesh) * config.train.grad_accum_steps
    distribution = keras.distribution.distribution()  # as the trainer lays a batch out
    batch = tuple(jax.ShapeDtypeStruct(spec.shape, spec.dtype,
                                       sharding=distribution.get_data_layout(spec.shape).backend_layout)
                  for spec in activations.abstract_inputs(model, rows))
    # What `fit` does first: build the compiled loss and metrics, whose variables are state.
    model._symbolic_build(data_batch=batch)
    state = tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
        model.metrics_variables))
    abstract_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                  state)
    # As Keras's jax trainer jits it: state donated, and laid out as it came in.
    step = jax.jit(model.train_step, donate_argnums=0,
                   out_shardings=(None, jax.tree.map(lambda a: a.sharding, state)))
    lowered = step.lower(abstract_state, batch)
    on_cpu = collectives and jax.default_backend() == "cpu"
    with tempfile.TemporaryDirectory() as dump:
        options = ({"xla_dump_to": dump, "xla_dump_hlo_pass_re": "spmd-partitioning"}
                   if on_cpu else {})
        compiled = lowered.compile(compiler_options=options)
        partitioned = glob.glob(os.path.join(dump, "*after_spmd-partitioning*.txt"))
        partitioned = open(partitioned[0]).read() if partitioned else None
    analysis = compiled.memory_analysis()
    held = {"arguments": analysis.argument_size_in_bytes,
            "outputs": analysis.output_size_in_bytes - analysis.alias_size_in_bytes,
            "temporaries": analysis.temp_size_in_bytes}
    result = {**held, "total": sum(held.values())}
    if not collectives:
        return result
    count = lambda text: compiled_traffic.sent_per_device(text, jax.device_count(), slices)
    result["sent_per_step"] = count(compiled.as_text())
    if partitioned:  # on CPU: the partitioner's collectives, before XLA:CPU widens bf16 ones
        before = count(partitioned)
        if abs(before["total"] - result["sent_per_step"]["total"]) > 0.01 * before["total"]:
            result["cpu_sent_per_step"] = result["sent_per_step"]
        result["sent_per_step"] = before
    return result
