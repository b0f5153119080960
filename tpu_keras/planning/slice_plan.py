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
slices x data x fsdp; weights never split across slices).

Then whether the sum fits the device's HBM less a margin (room for XLA's
own buffers and fragmentation), and the largest global batch that would.
Nothing is allocated; it needs the jax extra. `--measure` checks the plan
against XLA (`compiled_step`); `--auto` searches the layouts (`layout_search`).
"""

# Imported inside functions: Keras and the models that import it (the engine must be
# selected first: engine.select); JAX (optional: absent on a plain install; the tf engine
# runs without JAX); NumPy (start-up time: not every caller needs it).
import functools

from tpu_keras import data_section
from tpu_keras.config import REMAT_MODES
from tpu_keras.cluster import engine, libtpu, topology
from tpu_keras.errors import UserError
from tpu_keras.parallelism import mesh as mesh_lib
from tpu_keras.planning import compiled_step, layout_report, network, tpu_compiler
from tpu_keras.planning.layout_report import format_bytes
from tpu_keras.training import defaults


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
        self.precision = defaults.precision(config.train, "tpu")  # the plan is for a TPU slice
        keras.config.set_dtype_policy(self.precision)
        self.builder, self.kwargs = models.registry.get(config.model)
        self.model, self.optimizer = layout_report.abstract_model(config)

    @functools.cached_property
    def remat_modes(self) -> tuple:
        """The `train.remat` settings this model takes: 'blocks' where it has transformer blocks."""
        from tpu_keras.models import block_remat
        return tuple(m for m in REMAT_MODES if m != "blocks" or block_remat.blocks(self.model))

    @functools.lru_cache(maxsize=None)
    def activation_line(self, remat: str, mesh: tuple[int, int, int] = (1, 1, 1)) -> tuple[float, float]:
        """(constant, per example): the activation bytes per device at batch b are
        constant + b x per example. `mesh` (data, fsdp, model) matters through its
        model axis, which splits what tensor parallelism splits."""
        from tpu_keras.planning import activations
        model_size = mesh[2]
        if mesh != (1, 1, model_size):
            return self.activation_line(remat, (1, 1, model_size))
        split = {}
        if model_size > 1:
            placements = layout_report.placements(self.config, dict(zip(mesh_lib.AXES, mesh)), self.model)
            split = {p.path: p.axes.index("model") for p in placements if "model" in p.axes}
        model = self._model_with(remat)
        one, two = (activations.residual_bytes(self._backward(remat, b), model, split, model_size)
                    for b in (1, 2))
        return 2 * one - two, two - one

    @functools.lru_cache(maxsize=None)
    def _model_with(self, remat: str):
        """The model built under `remat` (`registry.made_with_remat`), no memory
        behind it. On the jax engine its attention is the TPU's fused kernel where a run on
        the slice routes it there (`models.splash_attention`), which keeps no scores."""
        import keras
        from tpu_keras import models
        from tpu_keras.models import splash_attention
        with keras.StatelessScope(initialize_variables=False):
            model = models.registry.made_with_remat(lambda: self.builder.make(**self.kwargs), remat,
                                                    self.config.model)
        if self.config.engine == "jax":
            splash_attention.route_layers(model, one_device=True)
        return model

    @functools.lru_cache(maxsize=None)
    def _backward(self, remat: str, batch: int):
        """`activations.backward_trace` of the `remat` model at `batch`: one trace per remat setting
        and batch, whatever the mesh (a trace of a 1B model takes seconds). Its layers
        keep the remat they were made with."""
        import keras
        from tpu_keras.planning import activations
        with keras.StatelessScope(initialize_variables=False):
            return activations.backward_trace(self._model_with(remat), self.builder.loss(), batch)

    @functools.cached_property
    def _traced_weights(self):
        """(the matmuls and lookups that read each weight, the bytes per element each cast
        weight is used in), from one trace (`planned_traffic.weight_uses`)."""
        from tpu_keras.planning import planned_traffic
        itemsizes = {}
        return planned_traffic.weight_uses(self.model, self.builder.loss(), itemsizes), itemsizes

    @property
    def weight_uses(self):
        return self._traced_weights[0]

    @property
    def itemsizes(self) -> dict:
        return self._traced_weights[1]

    @functools.lru_cache(maxsize=None)
    def layout(self, mesh: tuple[int, int, int]) -> dict:
        """The layout report on `mesh` (data, fsdp, model); a one-line error if the rules do not fit it."""
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
        totals = self.layout((1, 1, 1))["totals"]
        return totals["parameters"]["bytes"] + totals["optimizer"]["bytes"]

    @functools.cached_property
    def weight_dtypes(self) -> dict:
        """{'frozen' | 'trainable': {dtype: bytes}} of the weights, all devices together: a
        LoRA run's frozen base in bfloat16 (or quantized) and its factors in float32, say."""
        trainable = {v.path for v in self.model.trainable_variables}
        found = {"frozen": {}, "trainable": {}}
        for row in self.layout((1, 1, 1))["weights"]:
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


def _key(mesh: dict) -> tuple[int, int, int]:
    return tuple(mesh[axis] for axis in mesh_lib.AXES)


def describe(mesh: dict, slices: int = 1) -> str:
    """'slices=2 x data=4 x model=2'."""
    return (f"slices={slices} x " if slices > 1 else "") + mesh_lib.describe(mesh)


def tpu_slices(config, tpu: str):
    """(slices, one slice) of `--tpu`, checked against the config's mesh.slices."""
    slices, found = topology.parse_tpu(tpu)
    wanted = int(dict(config.mesh).get("slices", 1))
    if wanted not in (1, slices):
        raise UserError(f"mesh.slices={wanted} but --tpu={tpu} is {slices} slice(s); write "
                        f"--tpu={wanted}x{found.name}, or set mesh.slices to {slices}")
    return slices, found


def one_slice_mesh(config, found) -> dict:
    """The config's per-slice (data, fsdp, model) on one slice of `found`."""
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
                        f"batch splits ({'slices x ' if slices > 1 else ''}data x fsdp) of "
                        f"{slice_name}; use a multiple of {splits}")
    per_replica = global_batch // splits
    # DPO (data.preferences): an example is a pair, two sequences through the model. Its
    # reference's forward pass keeps nothing for the backward; with LoRA it is the base with
    # the adapters off, otherwise a frozen copy of the weights (models.preference). GRPO
    # (data.prompts): an example is a completion; the reference is DPO's, none with beta 0.
    kind = data_section.kind(config.data)
    sequences = 2 if kind == "preferences" else 1
    footprint = Footprint(config)
    remat = config.train.remat
    per_device = footprint.per_device(mesh, per_replica * sequences, remat)
    reference = 0
    if (kind == "preferences" or (kind == "prompts" and config.grpo.beta > 0)) \
            and not config.model.get("lora_rank"):
        reference = per_device["parameters"]
        per_device = {**per_device, "reference": reference, "total": per_device["total"] + reference}
    if kind == "prompts":
        per_device = _with_sampling(per_device, footprint, config, mesh, per_replica)
    largest = footprint.largest_batch(mesh, remat, usable - reference) // sequences
    sent = footprint.sent_per_step(mesh, per_replica * sequences, config.train.grad_accum_steps,
                                   slices)
    result = {
        "model": config.model.name, "slice": found.name, "slices": slices,
        "generation": found.generation.name,
        "hosts": found.hosts * slices, "devices": found.devices * slices, "mesh": mesh,
        "hbm_bytes_per_device": found.hbm_bytes_per_device, "margin": margin,
        "usable_bytes_per_device": usable, "precision": footprint.precision, "remat": remat,
        "global_batch": global_batch, "per_replica_batch": per_replica,
        "sequences_per_example": sequences,
        "num_generations": config.grpo.num_generations if kind == "prompts" else None,
        "grad_accum_steps": config.train.grad_accum_steps,
        "per_device": per_device,
        "weights": footprint.weight_dtypes,
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
    from tpu_keras.planning import sampling_cache
    context = config.model.get("context_length") or config.data.tokens.context_length
    itemsize = 2 if "bfloat16" in footprint.precision else 4
    cache = sampling_cache.cache_bytes(footprint.model, rows, context, mesh["model"], itemsize)
    step = per_device["gradients"] + per_device["activations"]
    return {**per_device, "sampling": cache, "total": per_device["total"] + max(0, cache - step)}


MARGIN_NOTE = ("HBM is what the devices report usable, not the published capacity; --margin "
               "keeps room for XLA's own buffers, padding and fragmentation")


def _sent_parts(sent: dict) -> str:
    parts = [(key.replace("_", " "), value) for key, value in sent.items() if key != "total" and value]
    return ", ".join(f"{name} {format_bytes(value)}" for name, value in parts) or "nothing"


def format_seconds(seconds) -> str:
    if seconds is None:
        return "no published bandwidth"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def format_network(n: dict) -> str:
    """'inside slices 1.2 GiB (ICI, 3.4 ms), across slices 10 MiB (DCN, 5.6 ms): 9.0 ms'."""
    inside = f"inside the slice {format_bytes(n['inside_slice'])} (ICI, {format_seconds(n['ici_seconds'])})"
    if n["slices"] == 1:
        return inside
    return (f"{inside}, across the {n['slices']} slices {format_bytes(n['across_slices'])} "
            f"(DCN, {format_seconds(n['dcn_seconds'])}): {format_seconds(n['seconds'])} in all")


NETWORK_NOTE = ("estimated time: bytes over the published bandwidth (ICI: half the bidirectional "
                "figure per chip; DCN: the host network's share per chip), without latency or "
                "overlap with compute")


def measured_notes(sent: dict, m: dict) -> list[str]:
    """The across-slice check, and what XLA:CPU sends that a TPU would not."""
    lines = []
    if m.get("slices", 1) > 1:
        planned, compiled = network.across_slices(sent), network.across_slices(m["sent_per_step"])
        tpu = m.get("backend") == "tpu"
        how = ("in the transfers the TPU compiler hands the data-center network (DCN)" if tpu
               else "by the compiled collectives whose groups span slices")
        lines.append(f"  {'across slices':<16} {format_bytes(compiled):>11}  {how} (plan / "
                     f"{'compiler' if tpu else 'XLA'} = {planned / max(1, compiled):.2f})")
    if "cpu_sent_per_step" in m:
        lines.append(f"  note: XLA:CPU's own program sends {format_bytes(m['cpu_sent_per_step']['total'])} "
                     "after its backend passes, among them all-reduce-promotion and "
                     "float-normalization-bf16, which widen bf16 collectives to float32 (a TPU "
                     "reduces bf16 natively); the figures above are the SPMD partitioner's "
                     "collectives, in the dtypes a TPU sends")
    return lines


def weights_line(weights: dict) -> str:
    """'weights: frozen bfloat16 14.96 GiB, trainable float32 26.00 MiB (all devices together)'."""
    parts = [f"{kind} {dtype} {format_bytes(size)}" for kind in ("frozen", "trainable")
             for dtype, size in sorted(weights[kind].items(), key=lambda item: -item[1])]
    return f"weights: {', '.join(parts)} (all devices together)"


def format_plan(p: dict) -> str:
    """The plan as the command prints it: bytes per device, whether it fits, the largest batch."""
    mesh, d = p["mesh"], p["per_device"]
    note = {"parameters": "exact (the layout tool's arithmetic)", "optimizer": "exact",
            "gradients": "exact",
            "activations": "estimate: what the backward pass keeps"
                           + (f", remat {p['remat']}" if p.get("remat", "none") != "none"
                              else ", no rematerialisation")
                           + (", split as tensor parallelism splits them (errs high)"
                              if mesh["model"] > 1 else "")}
    where = f"{p['slices']} x {p['slice']}" if p.get("slices", 1) > 1 else p["slice"]
    lines = [f"{p['model']} on {where}: {p['devices']} devices on {p['hosts']} host(s), "
             f"{format_bytes(p['hbm_bytes_per_device'])} HBM per device",
             f"mesh {describe(mesh, p.get('slices', 1))}, global batch "
             f"{p['global_batch']:,} ({p['per_replica_batch']:,} per replica), {p['precision']}"]
    if p.get("weights", {}).get("frozen"):
        lines.append(weights_line(p["weights"]))
    if p.get("sequences_per_example", 1) == 2:
        lines.append("DPO: each example is a pair, 2 sequences (chosen, rejected); the reference's "
                     "forward pass keeps nothing for the backward, and " +
                     ("it is a frozen copy of the weights" if "reference" in d else
                      "it is the base with the adapters off, so it adds no weights"))
    if "sampling" in d:
        lines.append(f"GRPO: each step trains on {p['global_batch']:,} completions, "
                     f"grpo.num_generations={p['num_generations']} per prompt, sampled by the "
                     "policy first; the reference " +
                     ("is a frozen copy of the weights" if "reference" in d else
                      "adds no weights (LoRA's base with the adapters off, or none with beta 0)"))
    lines += ["", "per device"]
    labels = {"parameters": "parameters", "optimizer": "optimizer state",
              "gradients": "gradients", "activations": "activations"}
    if "reference" in d:
        labels["reference"] = "reference"
        note["reference"] = f"exact: {'GRPO' if 'sampling' in d else 'DPO'}'s frozen copy"
    if "sampling" in d:
        labels["sampling"] = "sampler cache"
        note["sampling"] = ("estimate: the KV cache and logits of the per-replica completions; "
                            "sampling and the step alternate, so the total counts the larger")
    for key, label in labels.items():
        lines.append(f"  {label:<16} {format_bytes(d[key]):>11}  {note[key]}")
    lines.append(f"  {'total':<16} {format_bytes(d['total']):>11}")
    lines += ["", f"sent per device per step: {format_bytes(p['sent_per_step']['total'])} "
                  f"({_sent_parts(p['sent_per_step'])})",
              f"  {format_network(p['network'])}", f"  {NETWORK_NOTE}"]
    if p.get("measured", {}).get("backend") == "tpu":
        lines += [""] + tpu_compiler.format_measured(p, p["measured"], format_bytes)
        if "sent_per_step" in p["measured"]:
            lines += measured_notes(p["sent_per_step"], p["measured"])
    elif "measured" in p:
        m = p["measured"]
        lines += ["", f"XLA's figures for the compiled step on {m['devices']} {m['backend']} "
                      "device(s), per device:",
                  f"  {'total':<16} {format_bytes(m['total']):>11}  arguments "
                  f"{format_bytes(m['arguments'])}, outputs {format_bytes(m['outputs'])}, "
                  f"temporaries {format_bytes(m['temporaries'])} (plan / XLA = "
                  f"{d['total'] / m['total']:.2f})",
                  f"  {'activations':<16} {format_bytes(m['activations']):>11}  the temporaries "
                  f"that grow with the batch (estimate / XLA = "
                  f"{d['activations'] / max(1, m['activations']):.2f})",
                  f"  {'sent per step':<16} {format_bytes(m['sent_per_step']['total']):>11}  by the "
                  f"compiled collectives ({_sent_parts(m['sent_per_step'])}; plan / XLA = "
                  f"{p['sent_per_step']['total'] / max(1, m['sent_per_step']['total']):.2f})"]
        lines += measured_notes(p["sent_per_step"], m)
    lines += ["", f"usable HBM: {format_bytes(p['usable_bytes_per_device'])} per device "
                  f"({p['margin']:.0%} kept free)", MARGIN_NOTE]
    share = d["total"] / p["usable_bytes_per_device"]
    compiled = p.get("measured", {}) if p.get("measured", {}).get("backend") == "tpu" else None
    if compiled:
        lines.append(("fits by the TPU compiler: yes, " if compiled["fits"] else
                      "fits by the TPU compiler: NO, ")
                     + (f"peak {format_bytes(compiled['peak'])}, {compiled['share_of_hbm']:.1%} of "
                        f"{format_bytes(compiled['hbm_bytes_per_device'])} HBM"
                        if compiled.get("peak") else "out of memory")
                     + ("" if compiled["fits"] else ": lower train.batch_size, split the weights "
                        "over mesh.fsdp or mesh.model, set train.remat, or use a larger slice"))
    if p.get("plan_fits", p["fits"]):
        lines.append(("the plan: " if compiled else "")
                     + (f"fits: yes, {share:.1%} of usable HBM" if share >= 0.001
                        else "fits: yes, under 0.1% of usable HBM"))
    else:
        lines.append(f"{'the plan: ' if compiled else ''}fits: NO, {share:.0%} of usable HBM: lower train.batch_size, split the "
                     "weights over mesh.fsdp or mesh.model (jax engine), or use a larger slice; "
                     "--auto searches the layouts")
    if p["largest_global_batch"]:
        lines.append(f"largest global batch that fits: {p['largest_global_batch']:,} "
                     f"({p['largest_global_batch'] // (mesh_lib.batch_splits(mesh) * p.get('slices', 1)):,} per "
                     "replica)")
    else:
        lines.append("largest global batch that fits: none (the weights, optimizer state and "
                     "gradients alone fill HBM)")
    return "\n".join(lines)
