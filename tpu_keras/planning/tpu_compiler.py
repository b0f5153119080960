"""The TPU compiler's own figures for the toolkit's training step, on a slice this machine lacks.

`python -m tpu_keras.plan --measure` asks this where libtpu (the TPU
runtime, the `tpu` extra) is installed. libtpu describes any slice without
a chip (`cluster.libtpu`: the devices of a v5litepod-16, or of two), and
its compiler compiles for them ahead of time, here, with JAX itself on the
CPU. So the step is the one a run trains with, built as a run builds it
(`training.setup.build_model`): the config's model with its remat setting,
its layout rules' `keras.distribution` on the slice's mesh (laid out on the
chips' coordinates as on a TPU VM, the slices outermost in data), its
optimizer, loss and metrics compiled by `training.optimization`, the
guarded step of `training.jax_steps` with its accumulation, in the dtype
policy a TPU run takes (`training.auto_values`: `auto` is mixed_bfloat16).
Nothing is allocated: the model and optimizer are built in a Keras
`StatelessScope` whose variables stay uninitialised, and the step is
lowered on abstract arrays (`jax.ShapeDtypeStruct` with the `NamedSharding`
each variable would get, and the batch split over `BATCH_AXES`), so any
model size compiles (MaxText's `train_compile.py` does the same for Flax).
Only the optimizer's step counter is a real scalar, made on the CPU before
the slice's distribution is set (Keras makes it from a value, which a
stateless scope refuses).

From the compiled program, per device:
- `memory_analysis()`: the arguments (weights, optimizer state, the batch),
  the outputs less those written over a donated argument, the temporaries,
  and the program's code; their sum is the peak held against the chip's
  HBM (`cluster.topology`: what the runtime lets a program use). The
  compiler's out-of-memory error, which it raises when its buffers cannot
  fit, is the same answer: does not fit, with its figures.
- `as_text()`: each collective, with the bytes one device sends in it and
  whether they cross the chip interconnect (ICI) or, between slices, the
  data-center network (DCN) (`planning.compiled_traffic`). A collective
  inside a loop (the accumulation's micro-batches) counts once.
- `cost_analysis()`: the FLOPs and the compiler's step-time estimate,
  'optimal_seconds'. It is an estimate of the compiler's cost model, and
  not always there: a missing, zero or negative value is none. The MFU it
  implies is the model FLOPs of the update (`measurement.flops`, as the
  training log counts them) over that time and the chips' bf16 peak.
"""

# Imported inside functions: Keras (the engine must be selected first: engine.select); JAX
# (optional: absent on a plain install; the tf engine runs without JAX); NumPy (start-up
# time: not every caller needs it).
import copy
import importlib.metadata
import re
import time

from tpu_keras import objectives
from tpu_keras.cluster import engine, libtpu, topology
from tpu_keras.cluster.record import Cluster
from tpu_keras.errors import UserError, first_line
from tpu_keras.parallelism import mesh as mesh_lib
from tpu_keras.parallelism.mesh import BATCH_AXES, batch_splits

OOM = "RESOURCE_EXHAUSTED"


def version() -> str:
    """'libtpu 0.0.42.1' (and the JAX that drives it)."""
    try:
        found = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        found = "unknown version"
    return f"libtpu {found}"


def name() -> str:
    """How the output names this compiler: 'TPU compiler (libtpu 0.0.42.1)'."""
    return f"TPU compiler ({version()})"


def measure(config, tpu: str, mesh: dict, batch_per_replica: int, step: str = "toolkit",
            attention: str = "auto") -> dict:
    """The TPU compiler's figures for one training step of `config` on the slice(s) `tpu`,
    on `mesh` (one slice's data, fsdp, model) at `batch_per_replica` (a dict, JSON-ready).

    `step`: 'toolkit', the run's guarded step with its accumulation; 'keras', plain
    Keras's own `train_step` for the same model, optimizer, loss and metrics (what `fit`
    compiles without the toolkit; `train.grad_accum_steps` becomes the optimizer's
    `gradient_accumulation_steps`, one micro-batch a step), for the benchmark that
    weighs the toolkit's step against it.

    `attention`: 'auto', the attention a run on the TPU uses (splash attention where
    `models.splash_attention` routes the family); 'keras', keras-hub's own call of
    Keras's `dot_product_attention`, to compare.

    Raises a one-line `UserError` where libtpu cannot describe `tpu`. A step the
    compiler finds too large for HBM is no error: 'fits' is False and 'out_of_memory'
    holds the compiler's words.
    """
    import jax
    slices, found = topology.parse_tpu(tpu)
    chips = libtpu.devices(tpu)  # a one-line error where libtpu does not describe it
    started = time.perf_counter()
    with engine.keras_settings_kept():
        model, config, backend_mesh, routed = _built(config, found, slices, mesh, chips, step,
                                                     attention)
        state, batch = _abstract_step_inputs(model, config, backend_mesh, batch_per_replica)
        built = time.perf_counter()
        step = jax.jit(model.train_step, donate_argnums=0,
                       out_shardings=(None, jax.tree.map(lambda a: a.sharding, state)))
        lowered = step.lower(state, batch)
        result = {"compiler": name(), "backend": "tpu", "libtpu": version().split(" ", 1)[1],
                  "jax": jax.__version__, "topology": found.topology_name,
                  "devices": len(chips), "slices": slices,
                  "hbm_bytes_per_device": found.hbm_bytes_per_device}
        try:
            compiled = lowered.compile()
        except Exception as error:  # JaxRuntimeError; the compiler's out-of-memory is an answer
            if OOM not in str(error):
                raise UserError(f"the {name()} could not compile the step for {tpu}: "
                                f"{first_line(error, 300)}") from None
            result.update(_out_of_memory(str(error), found))
        else:
            result.update(_figures(compiled, found, slices, len(chips)))
            result["splash_attention_layers"] = routed
            result.update(_estimate(result, model, config, found, len(chips)))
            if objectives.of(config).plan_terms(config)["sampling"]:  # GRPO's other program
                result["sampling"] = _sampling_figures(model, config, backend_mesh, batch_per_replica,
                                                       found)
                result["fits"] = result["fits"] and result["sampling"]["fits"]
        result["seconds"] = {"build": round(built - started, 1),
                             "compile": round(time.perf_counter() - built, 1)}
        return result


def _built(config, found, slices: int, mesh: dict, chips, step: str = "toolkit",
           attention: str = "auto"):
    """The config's model, compiled as a run compiles it, on the slice's devices; no memory
    behind its weights. Returns (model, the config as the run resolves it, the jax mesh, how
    many attention layers run splash attention)."""
    import keras
    from tpu_keras import models
    from tpu_keras.models import chunked_loss, context_attention, sequence_parallel, splash_attention
    from tpu_keras.parallelism import distribution
    from tpu_keras.training import auto_values, optimization

    config = copy.deepcopy(config)
    config.engine = "jax"
    whole = {mesh_lib.SLICES: slices, **{axis: mesh.get(axis, 1) for axis in mesh_lib.AXES}}
    config.mesh = dict(whole)
    config.train.steps_per_execution = 1  # one step is what is compiled
    grid = mesh_lib.grid_of(list(chips), whole)
    device_mesh = keras.distribution.DeviceMesh(grid.shape, mesh_lib.AXES, list(grid.flat))
    cluster = Cluster(strategy=None, kind="tpu", num_hosts=found.hosts * slices, host_index=0,
                      num_replicas=mesh_lib.batch_splits(whole),
                      device_kind=f"{len(chips)} x {chips[0].device_kind}", engine="jax",
                      mesh=whole, device_mesh=device_mesh)
    config.train.update(auto_values.resolve(config, cluster))  # the TPU's precision where it is 'auto'
    keras.config.set_dtype_policy(config.train.precision)
    builder, _ = models.registry.get(config.model)
    placer = models.registry.placer(config.model, config.layout, whole)
    keras.distribution.set_distribution(None)
    optimizer = optimization.make_optimizer(config.train)  # its step counter: one scalar, here
    distribution.set_layout(cluster, placer)
    with keras.StatelessScope(initialize_variables=False):  # variables without values
        model = models.build(config.model, remat=config.train.remat)
        chunked_loss.attach(model, config.train.loss_chunks)
        context_attention.route(model, whole)
        routed = (splash_attention.route(model, cluster)
                  if attention == "auto" and step == "toolkit" else 0)
        if config.layout.sequence_parallel:
            sequence_parallel.apply(model)
        placer.check(model.weights)
        if objectives.of(config).plans_its_wrapper:  # GRPO's step: the group model's
            model, builder = _wrapped(model, builder, config)
        for variable in model.weights:
            # What Keras does as it initialises a variable: take its layout from the
            # distribution. The optimizer's slots then take their weight's layout.
            variable._initialize_layout()
        if step == "keras":
            _compile_as_keras_does(model, builder, config.train, optimizer)
            config.train.grad_accum_steps = 1  # the optimizer accumulates: one micro-batch a step
        else:
            optimization.compile_model(model, builder, config.train, cluster, optimizer)
    return model, config, device_mesh.backend_mesh, routed


def _wrapped(policy, builder, config):
    """The objective's model around `policy` (GRPO's group model, with a frozen copy for a
    full fine-tune that holds a reference, as the run holds one), and its builder."""
    from tpu_keras import models
    from tpu_keras.models import lora
    objective = objectives.of(config)
    reference = None
    if objective.holds_reference(config) and not lora.adapted_layers(policy):
        reference = models.build(config.model, remat=config.train.remat)
    return objective.wrap(policy, reference, config), objective.builder(builder, config)


def _sampling_figures(model, config, backend_mesh, batch_per_replica: int, found) -> dict:
    """GRPO's sampling program (`models.grpo_sampling`), compiled for the slice as the run
    compiles it: the policy's weights as laid out, the batch's completions split over the
    batch axes, a buffer of the context. Its memory per device, beside the step's: the two
    programs run one after the other, so each must fit alone."""
    import jax
    import keras
    from jax.sharding import NamedSharding, PartitionSpec
    from tpu_keras.models import grpo_sampling
    grpo = config.grpo
    with keras.StatelessScope(initialize_variables=False):
        sampler = grpo_sampling.GroupSampler(
            model.policy, num_generations=grpo.num_generations, max_new=grpo.max_completion_length,
            stop_ids=[0], pad_id=1, temperature=grpo.temperature, top_p=grpo.top_p,
            longest_prompt=model.policy.input_shape[1])  # the longest a prompt may be
    distribution = keras.distribution.distribution()

    def abstract(variable):
        layout = variable._layout or distribution.get_variable_layout(variable)
        return jax.ShapeDtypeStruct(tuple(variable.shape), variable.dtype,
                                    sharding=getattr(layout, "backend_layout", layout))

    rows = batch_per_replica * batch_splits(config.mesh)
    split = NamedSharding(backend_mesh, PartitionSpec(BATCH_AXES))
    tokens, given = (jax.ShapeDtypeStruct((rows, sampler.length), dtype, sharding=split)
                     for dtype in ("int32", "bool"))
    seed = jax.ShapeDtypeStruct((2,), keras.backend.standardize_dtype(sampler.sampler.variables[0].dtype),
                                sharding=NamedSharding(backend_mesh, PartitionSpec()))
    try:
        compiled = sampler.compiled.lower([abstract(v) for v in sampler.variables], seed, tokens,
                                           given).compile()
    except Exception as error:  # JaxRuntimeError; the compiler's out-of-memory is an answer
        if OOM not in str(error):
            raise UserError(f"the {name()} could not compile GRPO's sampler: "
                            f"{first_line(error, 300)}") from None
        return {"fits": False, "out_of_memory": first_line(error, 300)}
    analysis = compiled.memory_analysis()
    held = {"arguments": analysis.argument_size_in_bytes,
            "outputs": analysis.output_size_in_bytes - analysis.alias_size_in_bytes,
            "temporaries": analysis.temp_size_in_bytes}
    peak = sum(held.values()) + analysis.generated_code_size_in_bytes
    return {**held, "peak": peak, "fits": peak <= found.hbm_bytes_per_device}


def _compile_as_keras_does(model, builder, train_config, optimizer):
    """`model.compile` as a plain Keras user writes it, with the run's optimizer, loss and
    metrics; accumulation is the optimizer's own. One micro-batch a step is compiled."""
    if train_config.grad_accum_steps > 1:
        optimizer.gradient_accumulation_steps = train_config.grad_accum_steps
    model.compile(optimizer=optimizer, loss=builder.loss(), weighted_metrics=builder.metrics(),
                  jit_compile=True)
    model.optimizer.build(model.trainable_variables)


def _abstract_step_inputs(model, config, backend_mesh, batch_per_replica: int):
    """(state, batch) as `jax.ShapeDtypeStruct`s with their shardings, as Keras's trainer
    hands them to the jitted step."""
    import jax
    import keras
    from tpu_keras.planning import activations

    rows = batch_per_replica * batch_splits(config.mesh) * config.train.grad_accum_steps
    distribution = keras.distribution.distribution()
    # As the trainer lays a batch out: its rows over BATCH_AXES, its tokens over `context`.
    batch = tuple(jax.ShapeDtypeStruct(spec.shape, spec.dtype,
                                       sharding=distribution.get_data_layout(spec.shape).backend_layout)
                  for spec in activations.abstract_inputs(model, rows))
    with keras.StatelessScope(initialize_variables=False):
        model._symbolic_build(data_batch=batch)  # the compiled loss and metrics, as fit does first

    def abstract(variable):
        layout = variable._layout or distribution.get_variable_layout(variable)
        sharding = getattr(layout, "backend_layout", layout)
        return jax.ShapeDtypeStruct(tuple(variable.shape), variable.dtype, sharding=sharding)

    state = tuple([abstract(v) for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
        model.metrics_variables))
    return state, batch


def _figures(compiled, found, slices: int, devices: int) -> dict:
    """Memory per device, the collectives and the cost analysis of the compiled step."""
    from tpu_keras.planning import compiled_traffic
    analysis = compiled.memory_analysis()
    held = {"arguments": analysis.argument_size_in_bytes,
            "outputs": analysis.output_size_in_bytes - analysis.alias_size_in_bytes,
            "temporaries": analysis.temp_size_in_bytes}
    program = analysis.generated_code_size_in_bytes
    total = sum(held.values())
    peak = total + program
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    estimate = cost.get("optimal_seconds")
    return {**held, "total": total, "program": program, "peak": peak,
            # libtpu's own peak figure (`peak_memory_in_bytes`), kept beside the sum of the
            # buffers; it parts from that sum both ways, and its definition is not published.
            "scheduled_peak": getattr(analysis, "peak_memory_in_bytes", None),
            "fits": peak <= found.hbm_bytes_per_device,
            "share_of_hbm": round(peak / found.hbm_bytes_per_device, 4),
            "sent_per_step": compiled_traffic.sent_per_device(text, devices, slices),
            "collectives": compiled_traffic.listed(text, devices, slices),
            "fused_kernels": text.count('custom_call_target="tpu_custom_call"'),
            "flops_per_device": cost.get("flops"),
            "bytes_accessed_per_device": cost.get("bytes accessed"),
            "step_seconds": float(estimate) if estimate and estimate > 0 else None}


def _estimate(result: dict, model, config, found, devices: int) -> dict:
    """The MFU the compiler's step time implies: one micro-batch's model FLOPs over that time
    and the devices' published bf16 peak (None without an estimate). The compiler's cost
    analysis counts a loop's body once, so with `train.grad_accum_steps` above 1 its FLOPs
    and its time are one micro-batch's and the update's (the FLOPs of 1 and of 4
    micro-batches came out equal), and 'estimate_covers' says so. Where the toolkit counts
    no model FLOPs (a model whose layers it has no rule for), the compiler's own FLOPs
    count instead, rematerialised ones included, and 'mfu_of' says so."""
    from tpu_keras.measurement import flops
    examples = config.train.batch_size  # one micro-batch: what the compiler's figures cover
    from tpu_keras.models import preference
    policy = preference.policy_of(model)  # GRPO's: its policy's update, and its reference's pass
    per_example = flops.training_flops_per_example(policy)
    if policy is not model and model.with_reference:
        per_example += flops.forward_flops_per_example(policy)
    model_flops = per_example * examples or None
    counted, of = model_flops, "model FLOPs"
    if not counted and result.get("flops_per_device"):
        counted, of = result["flops_per_device"] * devices, "the compiler's FLOPs"
    seconds = result["step_seconds"]
    mfu = counted / (seconds * devices * found.peak_flops_per_device) if seconds and counted else None
    covers = ("the step" if config.train.grad_accum_steps == 1 else
              f"one of the {config.train.grad_accum_steps} micro-batches (a loop's body counts "
              "once) and the update")
    return {"model_flops_per_micro_batch": model_flops,
            "mfu": round(mfu, 4) if mfu is not None else None, "mfu_of": of,
            "estimate_covers": covers}


_GIB = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _out_of_memory(message: str, found) -> dict:
    """The compiler's out-of-memory error as figures: what it needed, if it says, and HBM.

    libtpu writes 'Ran out of memory on HBM, the total memory required for HLO
    temporaries (43.28G) exceeds available HBM (15.75G)', or 'Used 20.50G of 15.75G hbm'.
    """
    text = message[message.index(OOM):]
    words = " ".join(text.split("\n\n", 1)[0].split())
    needed = (re.search(r"required[^(]*\(([\d.]+)([KMGT])i?B?\)", text)
              or re.search(r"Used ([\d.]+)([KMGT])i?B? of", text))
    required = round(float(needed.group(1)) * _GIB[needed.group(2)]) if needed else None
    return {"fits": False, "out_of_memory": words[:400], "peak": required,
            "share_of_hbm": round(required / found.hbm_bytes_per_device, 4) if required else None}


MEMORY_BOUND = 0.10  # the plan's memory is held to the compiler's peak within this share

# Why each of the plan's terms can part from the compiler's buffers, for the output.
WHY = {
    "state": "the compiler's arguments also hold the batch and the metrics' state",
    "temporaries_low": "the plan counts each tensor autodiff keeps for the backward pass once, "
                       "all alive at once (less constants and what cheap elementwise work "
                       "remakes from another); the compiler also recomputes some of them in the "
                       "backward pass, frees what it kept as the gradients appear, and keeps "
                       "small buffers in the chip's own memory",
    "temporaries_squeezed": "the compiler's peak is within {:.0%} of HBM: near its limit the TPU "
                            "compiler recomputes activations in the backward pass until the step "
                            "fits (a slower step), so its figure is what it squeezed into HBM",
    "temporaries_high": "the compiler's temporaries hold more than what autodiff keeps for the "
                        "backward pass: the backward pass's own buffers (the gradients of each "
                        "layer's activations, the collectives' buffers, tiles padded to the "
                        "chip's layout), which the plan does not count",
    "program": "the compiled code, which the plan does not count",
}


def terms(p: dict, m: dict) -> dict:
    """The plan's memory per device against the compiler's buffers, term by term:
    {term: {"plan", "compiler", "why"}}, and "differs_most" where the totals part by more
    than `MEMORY_BOUND`."""
    d = p["per_device"]
    planned_temporaries = d["gradients"] + d["activations"]
    result = {
        "weights and optimizer state": {"plan": d["parameters"] + d["optimizer"],
                                        "compiler": m["arguments"], "why": WHY["state"]},
        "gradients and activations": {
            "plan": planned_temporaries, "compiler": m["temporaries"],
            "why": _why_temporaries(planned_temporaries, m)},
        "program": {"plan": 0, "compiler": m["program"], "why": WHY["program"]},
    }
    if abs(d["total"] / max(1, m["peak"]) - 1) > MEMORY_BOUND:
        result["differs_most"] = max(
            (term for term in result),
            key=lambda term: abs(result[term]["plan"] - result[term]["compiler"]))
    return result


# libtpu rematerialises where the step would pass 95% of HBM
# (--xla_jf_rematerialization_percent_shared_memory_limit, libtpu 0.0.42).
SQUEEZED = 0.9


def _why_temporaries(planned: int, m: dict) -> str:
    if m["temporaries"] >= planned:
        return WHY["temporaries_high"]
    if m["peak"] >= SQUEEZED * m["hbm_bytes_per_device"]:
        return WHY["temporaries_squeezed"].format(1 - SQUEEZED)
    return WHY["temporaries_low"]


SENT_BOUND = 0.15  # the plan's bytes sent are held to the compiled collectives' within this share

# The plan's collectives by the compiled program's kind of collective.
_PLANNED_AS = {"all_gather": ("fsdp_all_gather",), "reduce_scatter": ("fsdp_reduce_scatter",),
               "all_reduce": ("gradient_all_reduce", "gradient_all_reduce_across_slices",
                              "model_all_reduce"),
               "all_to_all": (), "collective_permute": ()}
WHY_SENT = {
    "all_gather": ("the compiled program gathers a split weight again where it is used again "
                   "(the backward pass, a rematerialised layer), where the plan counts one "
                   "gather per weight and micro-batch"),
    "reduce_scatter": "the compiler splits or merges the gradients' reduce-scatters otherwise "
                      "than one per weight",
    "all_reduce": ("the compiler sums across devices otherwise than the plan's one all-reduce "
                   "per gradient and per split layer output (it may reduce-scatter instead, or "
                   "sum a layer's outputs at another point)"),
    "all_to_all": "the plan counts no all-to-all: a mixture of experts' exchange of tokens on "
                  "the expert axis, or the compiler moving data where one layout meets another",
    "collective_permute": "the plan counts no collective permute: the compiler passes data "
                          "between neighbours (a windowed matmul's pieces, a reshard)",
}


def sent_terms(p: dict, m: dict) -> dict:
    """The plan's bytes sent per device against the compiled collectives', by kind:
    {kind: {"plan", "compiler", "why"}}, and "differs_most" where the totals part by more
    than `SENT_BOUND`."""
    planned, compiled = p["sent_per_step"], m["sent_per_step"]
    result = {kind: {"plan": sum(planned.get(name, 0) for name in names),
                     "compiler": compiled.get(kind, 0) + compiled.get(f"{kind}_across_slices", 0),
                     "why": WHY_SENT[kind]}
              for kind, names in _PLANNED_AS.items()}
    apart = abs(planned["total"] / max(1, compiled["total"]) - 1)
    if planned["total"] != compiled["total"] and apart > SENT_BOUND:  # both 0: nothing sent
        result["differs_most"] = max(
            _PLANNED_AS, key=lambda kind: abs(result[kind]["plan"] - result[kind]["compiler"]))
    return result


