"""Will this config fit that TPU slice? Memory per device, before you pay for the slice.

The arithmetic behind `python -m tpu_keras.plan`. Per device of the slice,
on the config's mesh:
- parameters and optimizer state: exact, the layout report's arithmetic
  (`layout_report`) on the slice's device count;
- gradients: one per trainable weight, laid out like it (exact);
- activations: an estimate, the tensors autodiff keeps for the backward pass
  at the per-replica batch with the config's remat setting
  (`planning.activations`). With mesh.model > 1, those tensor parallelism
  splits count once per shard (`planning.model_split`); the rest whole.
- communication: the bytes each device sends per update, from the layout
  and the model's traced matmuls (`planning.planned_traffic`), split into
  inside the slice (chip interconnect) and across slices (data-center
  network) with an estimated time for each (`planning.network`).

Several slices (`--tpu=2xv5litepod-256`): the config's mesh is one slice's,
and the slices extend the data axis (`mesh.slices`, the batch split over
slices x data x fsdp x expert; weights never split across slices).

Then whether the sum fits the device's HBM less a margin (room for XLA's
own buffers and fragmentation), and the largest global batch that would.
Nothing is allocated; it needs the jax extra. `--measure` checks the plan
against XLA (`compiled_step`); `--auto` searches the layouts (`layout_search`).
"""

# Imported inside functions: Keras and the models that import it (the engine must be
# selected first: engine.select); JAX (optional: absent on a plain install; the tf engine
# runs without JAX); NumPy (start-up time: not every caller needs it).
import functools

from tpu_keras import objectives
from tpu_keras.config import REMAT_MODES
from tpu_keras.cluster import engine, libtpu, topology
from tpu_keras.errors import UserError
from tpu_keras.parallelism import mesh as mesh_lib
from tpu_keras.planning import compiled_step, layout_report, network, tpu_compiler
from tpu_keras.training import auto_values

_ONE = (1,) * len(mesh_lib.AXES)  # one device: a size of 1 on every axis
_MODEL = mesh_lib.AXES.index("model")
_EXPERT = mesh_lib.AXES.index("expert")
_CONTEXT = mesh_lib.AXES.index(mesh_lib.CONTEXT)


class Footprint:
    """What planning needs of one config's model, worked out once for any mesh and batch.

    The model and its optimizer are built once without memory behind them.
    Per remat setting, the activation bytes are a line in the batch
    (what does not grow with it, plus bytes per example). Per mesh, the
    layout gives the exact weight, optimizer and gradient bytes per device,
    and with the model's traced matmuls, the bytes each device sends.
    """

    def __init__(self, config):
        engine.select("jax")  # the allocation-free build, whatever engine trains
        import keras
        from tpu_keras import models
        self.config = config
        self.precision = auto_values.precision(config.train, "tpu")  # the plan is for a TPU slice
        keras.config.set_dtype_policy(self.precision)
        self.builder, self.kwargs = models.registry.get(config.model)
        self.model, self.optimizer = layout_report.abstract_model(config)

    @functools.cached_property
    def remat_modes(self) -> tuple:
        """The `train.remat` settings this model takes: 'blocks' where it has transformer blocks."""
        from tpu_keras.models import block_remat
        return tuple(m for m in REMAT_MODES if m != "blocks" or block_remat.blocks(self.model))

    @functools.lru_cache(maxsize=None)
    def activation_line(self, remat: str, mesh: tuple = _ONE) -> tuple[float, float]:
        """(constant, per example): the activation bytes per device at batch b are
        constant + b x per example. `mesh` (one slice's sizes of `AXES`) matters through its
        model axis, which splits what tensor parallelism splits, its expert axis, whose
        devices each gather the axis's tokens for their own experts (`models.moe`), and its
        context axis, whose devices each hold their share of every sequence: counted as that
        share of the activations (what attention gathers of the keys and values is the
        compiler's to tell, `--measure`)."""
        from tpu_keras.planning import activations
        model_size = mesh[_MODEL]
        kept = tuple(size if axis in (_MODEL, _EXPERT) else 1 for axis, size in enumerate(mesh))
        if mesh != kept:
            constant, per_example = self.activation_line(remat, kept)
            return constant / mesh[_CONTEXT], per_example / mesh[_CONTEXT]
        split = {}
        if model_size > 1:
            placements = layout_report.placements(self.config, dict(zip(mesh_lib.AXES, mesh)), self.model)
            split = {p.path: p.axes.index("model") for p in placements if "model" in p.axes}
        model = self._model_with(remat)
        stream = self._stream if model_size > 1 else None
        one, two = (activations.residual_bytes(self._backward(remat, b, mesh[_EXPERT]), model, split,
                                               model_size, stream) for b in (1, 2))
        constant, per_example = 2 * one - two, two - one
        if remat == "blocks":  # and the insides of the one block whose backward pass runs
            from tpu_keras.models import block_remat
            inside = self.activation_line("none", mesh)
            count = len(block_remat.blocks(self.model))
            constant, per_example = constant + inside[0] / count, per_example + inside[1] / count
        return constant, per_example

    @functools.cached_property
    def _stream(self) -> tuple | None:
        """(tokens, width) of the residual stream where `layout.sequence_parallel` splits it
        along the sequence over `model` (`models.sequence_parallel`); else None."""
        if not self.config.layout.get("sequence_parallel"):
            return None
        widths = [layer.hidden_dim for layer in self.model._flatten_layers(include_self=True)
                  if isinstance(getattr(layer, "hidden_dim", None), int)]  # keras-hub's backbone
        return (self.config.model.context_length, widths[0]) if widths else None

    @functools.lru_cache(maxsize=None)
    def _model_with(self, remat: str):
        """The model built under `remat` (`registry.made_with_remat`), no memory
        behind it. On the jax engine its attention is the TPU's fused kernel where a run on
        the slice routes it there (`models.splash_attention`), which keeps no scores."""
        import keras
        from tpu_keras import models
        from tpu_keras.models import chunked_loss, splash_attention
        with keras.StatelessScope(initialize_variables=False):
            model = models.registry.made_with_remat(lambda: self.builder.make(**self.kwargs), remat,
                                                    self.config.model)
        chunked_loss.attach(model, self.config.train.loss_chunks)  # the logits a piece at a time
        if self.config.engine == "jax":
            splash_attention.route_layers(model, one_device=True)
        return model

    @functools.lru_cache(maxsize=None)
    def _backward(self, remat: str, batch: int, expert_axis: int = 1):
        """`activations.backward_trace` of the `remat` model at `batch`: one trace per remat setting,
        batch and expert axis (a mixture of experts' layers traced as one device of that axis
        runs them), whatever the rest of the mesh (a trace of a 1B model takes seconds). Its
        layers keep the remat they were made with."""
        import keras
        from tpu_keras.models import moe
        from tpu_keras.planning import activations
        with keras.StatelessScope(initialize_variables=False), moe.traced_as_on_a_tpu(expert_axis):
            return activations.backward_trace(self._model_with(remat), self.builder.loss(), batch)

    @functools.cached_property
    def _traced_weights(self):
        """(the matmuls and lookups that read each weight, the bytes per element each cast
        weight is used in), from one trace (`planned_traffic.weight_uses`)."""
        from tpu_keras.planning import planned_traffic
        itemsizes = {}
        return planned_traffic.weight_uses(self.model, self.builder.loss(), itemsizes), itemsizes

    @functools.cached_property
    def experts(self):
        """A mixture of experts' total and active parameters (`models.moe.parameters`); None: dense."""
        from tpu_keras.models import moe
        return moe.parameters(self.model)

    @property
    def weight_uses(self):
        return self._traced_weights[0]

    @property
    def itemsizes(self) -> dict:
        return self._traced_weights[1]

    @functools.lru_cache(maxsize=None)
    def layout(self, mesh: tuple) -> dict:
        """The layout report on `mesh` (data, fsdp, expert, context, model); a one-line error if the rules do not fit it."""
        return layout_report.report_on(self.config, dict(zip(mesh_lib.AXES, mesh)), self.model,
                                       self.optimizer)

    def per_device(self, mesh: dict, batch_per_replica: int, remat: str) -> dict:
        """Bytes per device at `batch_per_replica` examples per batch split."""
        totals = self.layout(_key(mesh))["totals"]
        constant, per_example = self.activation_line(remat, _key(mesh))
        d = {"parameters": totals["parameters"]["bytes_per_device"],
             "optimizer": totals["optimizer"]["bytes_per_device"],
             "gradients": totals["gradients"]["bytes_per_device"],
             "activations": round(constant + per_example * batch_per_replica)}
        d["total"] = sum(d.values())
        return d

    def largest_batch(self, mesh: dict, remat: str, usable: int) -> int:
        """The most examples per batch split that fit `usable` bytes per device (0: none)."""
        constant, per_example = self.activation_line(remat, _key(mesh))
        fixed = self.per_device(mesh, 0, remat)["total"]
        return max(0, int((usable - fixed) // per_example)) if per_example > 0 else 0

    @property
    def state_bytes(self) -> int:
        """Bytes of the weights and the optimizer state in all (the same on any mesh)."""
        totals = self.layout(_ONE)["totals"]
        return totals["parameters"]["bytes"] + totals["optimizer"]["bytes"]

    @functools.cached_property
    def weight_dtypes(self) -> dict:
        """{'frozen' | 'trainable': {dtype: bytes}} of the weights, all devices together: a
        LoRA run's frozen base in bfloat16 (or quantized) and its factors in float32, say."""
        trainable = {v.path for v in self.model.trainable_variables}
        found = {"frozen": {}, "trainable": {}}
        for row in self.layout(_ONE)["weights"]:
            kind = found["trainable" if row["path"] in trainable else "frozen"]
            kind[row["dtype"]] = kind.get(row["dtype"], 0) + row["bytes_per_device"]
        return found

    def sent_per_step(self, mesh: dict, batch_per_replica: int, grad_accum_steps: int = 1,
                      slices: int = 1) -> dict:
        """Bytes each device sends per optimizer update (`planning.planned_traffic`);
        `mesh` is one slice's."""
        from tpu_keras.planning import planned_traffic
        placements = layout_report.placements(self.config, mesh, self.model)
        trainable = {v.path for v in self.model.trainable_variables}
        return planned_traffic.per_step(placements, trainable, self.weight_uses, mesh,
                                      batch_per_replica, grad_accum_steps, slices, self.itemsizes)


def _key(mesh: dict) -> tuple[int, ...]:
    return tuple(mesh.get(axis, 1) for axis in mesh_lib.AXES)


def tpu_slices(config, tpu: str):
    """(slices, one slice) of `--tpu`, checked against the config's mesh.slices."""
    slices, found = topology.parse_tpu(tpu)
    wanted = int(dict(config.mesh).get("slices", 1))
    if wanted not in (1, slices):
        raise UserError(f"mesh.slices={wanted} but --tpu={tpu} is {slices} slice(s); write "
                        f"--tpu={wanted}x{found.name}, or set mesh.slices to {slices}")
    return slices, found


def one_slice_mesh(config, found) -> dict:
    """The config's per-slice (data, fsdp, expert, context, model) on one slice of `found`."""
    mesh_config = {k: v for k, v in dict(config.mesh).items() if k != mesh_lib.SLICES}
    resolved = mesh_lib.resolve(mesh_config, found.devices, config.engine)
    return {axis: resolved[axis] for axis in mesh_lib.AXES}  # the slices are the plan's own


def network_estimate(sent: dict, found, slices: int) -> dict:
    return network.estimate(sent, found.generation, slices)


def usable_bytes(found, margin: float) -> int:
    if not 0 <= margin < 1:
        raise UserError(f"--margin={margin} must be at least 0 and below 1, e.g. 0.1 for 10%")
    return int(found.hbm_bytes_per_device * (1 - margin))


COMPILERS = ("auto", "tpu", "cpu")


def resolve_compiler(compiler: str) -> str:
    """'tpu' or 'cpu' for `--compiler` (or `plan_model`'s `compiler`): 'auto' is the TPU's
    own where libtpu is installed."""
    if compiler not in COMPILERS:
        raise UserError(f"compiler={compiler!r}: use one of {', '.join(COMPILERS)}")
    if compiler == "auto":
        return "tpu" if libtpu.installed() else "cpu"
    if compiler == "tpu" and not libtpu.installed():
        raise UserError(f"the TPU compiler needs libtpu, the TPU runtime: {libtpu.INSTALL}; or "
                        "use the cpu compiler (XLA:CPU on fake devices)")
    return compiler


def plan(config, slice_name: str, margin: float = 0.1, measure: bool = False,
         compiler: str = "cpu") -> dict:
    """The memory plan of `config` on the slice `slice_name` (a dict, JSON-ready).

    `measure` adds the compiled step's figures under 'measured', from `compiler`:
    'cpu', XLA:CPU on as many fake devices as the slices have (`compiled_step`), or
    'tpu', the TPU compiler for the slices' own devices (`tpu_compiler`), whose
    verdict is then 'fits' (the plan's own is kept as 'plan_fits')."""
    slices, found = tpu_slices(config, slice_name)
    usable = usable_bytes(found, margin)
    mesh = one_slice_mesh(config, found)
    global_batch = config.train.batch_size
    splits = mesh_lib.batch_splits(mesh) * slices
    if global_batch % splits:
        raise UserError(f"train.batch_size={global_batch} does not divide over the {splits} "
                        f"batch splits ({'slices x ' if slices > 1 else ''}data x fsdp x expert) of "
                        f"{slice_name}; use a multiple of {splits}")
    per_replica = global_batch // splits
    # The objective's terms. DPO: an example is a pair, two sequences through the model, and
    # its reference's forward pass keeps nothing for the backward; with LoRA the reference
    # is the base with the adapters off, otherwise a frozen copy of the weights. GRPO: an
    # example is a completion, sampled first; its reference is DPO's, none with beta 0.
    objective = objectives.of(config)
    terms = objective.plan_terms(config)
    sequences = objective.sequences_per_example
    footprint = Footprint(config)
    remat = config.train.remat
    per_device = footprint.per_device(mesh, per_replica * sequences, remat)
    reference = 0
    if terms["reference"]:
        reference = per_device["parameters"]
        per_device = {**per_device, "reference": reference, "total": per_device["total"] + reference}
    if terms["sampling"]:
        per_device = _with_sampling(per_device, footprint, config, mesh, per_replica)
    largest = footprint.largest_batch(mesh, remat, usable - reference) // sequences
    sent = footprint.sent_per_step(mesh, per_replica * sequences, config.train.grad_accum_steps,
                                   slices)
    result = {
        "model": config.model.name, "objective": objective.name, "slice": found.name, "slices": slices,
        "generation": found.generation.name,
        "hosts": found.hosts * slices, "devices": found.devices * slices, "mesh": mesh,
        "hbm_bytes_per_device": found.hbm_bytes_per_device, "margin": margin,
        "usable_bytes_per_device": usable, "precision": footprint.precision, "remat": remat,
        "global_batch": global_batch, "per_replica_batch": per_replica,
        "sequences_per_example": sequences,
        "num_generations": config.grpo.num_generations if terms["sampling"] else None,
        "grad_accum_steps": config.train.grad_accum_steps,
        "per_device": per_device,
        "weights": footprint.weight_dtypes,
        "experts": footprint.experts,
        "fits": per_device["total"] <= usable,
        "largest_global_batch": largest * splits,
        "sent_per_step": sent,
        "network": network_estimate(sent, found, slices),
    }
    if measure and compiler == "tpu":
        result["measured"] = tpu_compiler.measure(config, slice_name, mesh, per_replica * sequences)
        result["plan_fits"], result["fits"] = result["fits"], result["measured"]["fits"]
    elif measure:
        result["measured"] = compiled_step.measure(config, mesh, per_replica * sequences,
                                                   footprint.state_bytes,
                                                   slices)
    return result


def _with_sampling(per_device: dict, footprint, config, mesh: dict, rows: int) -> dict:
    """GRPO's per-device bytes with the sampler's cache: the larger of it and the training
    step's gradients and activations counts, as the two never run at once."""
    from tpu_keras.planning import kv_cache
    context = config.model.get("context_length") or config.data.tokens.context_length
    itemsize = 2 if "bfloat16" in footprint.precision else 4
    cache = kv_cache.cache_bytes(footprint.model, rows, context, mesh["model"], itemsize)
    step = per_device["gradients"] + per_device["activations"]
    return {**per_device, "sampling": cache, "total": per_device["total"] + max(0, cache - step)}


