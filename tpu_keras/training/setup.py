"""How a run is set up: `set_up(config, workdir, ...)`, for training and for every command that reads a run.

One recipe, in order: the config checked; the engine selected; TensorFlow told
of the compile cache; the cluster connected; the config resolved
(`training.run_config`: what `auto`, `{workdir}` and the model leave open) and,
by the chief of a training run, written to WORKDIR/config.json; the model built
as a run builds it (`build_model`; on packed text with bits per byte:
`with_text_metrics`); the checkpointer opened. It returns a `RunSetup`.

`training.loop.train`, `training.evaluation.evaluate` and `training.restored.load`
(behind `python -m tpu_keras.export` and `generate`) each start here; what
differs between them is an argument of `set_up`.

Keras reads its backend once, when it is first imported, so everything that
imports Keras or TensorFlow is imported inside the functions below, after
`set_up` has selected the engine.
"""

# Imported inside functions: Keras and TensorFlow (the engine must be selected first:
# engine.select); JAX (optional: absent on a plain install; the tf engine runs without
# JAX); NumPy (start-up time: not every caller needs it).
import contextlib
import dataclasses
import math
import os
import threading

from absl import logging

from tpu_keras import cluster as cluster_lib, config as config_lib, data_section, objectives
from tpu_keras.cluster import engine
from tpu_keras.errors import UserError
from tpu_keras.training import compile_cache


@dataclasses.dataclass
class RunSetup:
    """What `set_up` made: the run's pieces, ready to train, evaluate or restore."""
    cluster: object          # tpu_keras.cluster.Cluster
    config: object           # the resolved config, frozen (training.run_config)
    objective: object        # what the model trains for (tpu_keras.objectives.Objective)
    builder: object          # the model's registry entry (tpu_keras.models.registry.Builder),
                             # with the objective's loss and metrics
    model_kwargs: dict       # ... and its keyword arguments
    model: object            # keras.Model, built and compiled as a run compiles it
    text_source: object      # packed text's eval source (data.text.PackedSource), or None
    checkpointer: object     # training.checkpoint: TFCheckpointer or OrbaxCheckpointer
    compile_counter: object  # training.compile_cache.CompileCounter, or None


def set_up(config, workdir: str, *, trains: bool = False, one_device: bool = False,
           refit_mesh: bool = False, single_tf_process: str = "", timings=None) -> RunSetup:
    """The run of `config` in `workdir`, set up on this process's cluster.

    `trains`: the training run itself. Its workdir is made, SIGTERM saves a checkpoint
    from here on, the chief writes config.json, records the base a LoRA run's checkpoints
    need (`models.frozen_base`) and keeps the model (`models.preset_copy`), Keras is
    seeded, and the checkpointer keeps `checkpoint.keep` checkpoints. Its weights come
    from a checkpoint once it has one (a LoRA run's frozen base from its preset again);
    every other command reads the checkpoints of a run, so its weights always do.

    `one_device`: the model on this host's first device, only for a checkpoint to be
    restored into (export, generate): whatever mesh and hosts the run trained on
    (Orbax and TensorFlow both reshard on restore), however many devices this host
    has; no compile cache, and no text source (its metrics are not used).

    `refit_mesh`: on jax, a mesh of fixed sizes that this job's devices do not fit is
    fitted to them (`parallelism.mesh.refit`; an evaluation job on another host).

    `single_tf_process`: the name of a command that runs in one TensorFlow process
    (evaluate); on several, it stops with a one-line error once the cluster is known.

    `timings` (a `measurement.timings.RunTimings`) counts the cluster, data and model phases.
    """
    phase = timings.phase if timings is not None else lambda name: contextlib.nullcontext()
    if one_device:
        config = _on_one_device(config)
    objectives.check(config)
    engine.select(config.engine, config.cluster.virtual_devices)  # before Keras loads
    if not one_device:
        compile_cache.prepare(config.train.compile_cache, workdir, config.engine)  # before TF starts
    import keras
    import tensorflow as tf
    from tpu_keras import data, models, workdir as workdir_lib
    from tpu_keras.models import export, frozen_base
    from tpu_keras.training import checkpoint, preemption, run_config
    models.registry.import_all(config.model.get("imports", ()))  # the user's builders, objectives
    objectives.check_registered(config)  # a user's own objective is registered by now

    if trains:
        workdir_lib.prepare(workdir)
        if threading.current_thread() is threading.main_thread():
            preemption.watch()  # from here on, SIGTERM means "save and exit 42"
    with phase("cluster"):
        cluster = cluster_lib.connect(config.cluster, engine=config.engine, mesh=config.mesh,
                                      refit_mesh=config.train.batch_size if refit_mesh else 0)
    if single_tf_process and cluster.num_processes > 1 and cluster.engine != "jax":
        raise UserError(f"{single_tf_process} runs in one TensorFlow process; start it on one "
                        "host (cluster.strategy one_device or mirrored), or use the jax engine")
    checkpointed = checkpoint.any_saved(workdir) if trains else True
    resolved = run_config.resolve(config, cluster, workdir, checkpointed)
    keras.config.set_dtype_policy(resolved.train.precision)
    compile_counter = None if one_device else compile_cache.enable(
        resolved.train.compile_cache, workdir, cluster, resolved.train.jit_compile)
    if trains:
        if cluster.is_chief:
            workdir_lib.write_whole(os.path.join(workdir, "config.json"),
                                    run_config.to_json(resolved, config))
        keras.utils.set_random_seed(resolved.seed)
        if resolved.deterministic and resolved.engine == "tf":
            tf.config.experimental.enable_op_determinism()

    models.hub.prepare_preset(resolved.model, workdir, cluster.is_chief)  # a {workdir} preset
    objective = objectives.of(resolved)
    builder, model_kwargs = models.registry.get(resolved.model)
    if trains:  # the tokenizer its export carries, read before the run trains
        export.check_tokenizer(resolved)
    text_source = None
    if not one_device and data_section.kind(resolved.data) in ("text", "instructions"):
        # Its tokens per byte turn bits per token into bits per byte.
        with phase("data"):
            text_source = data.text.open_source(resolved.data, training=False,
                                                hosts=(cluster.host_index, cluster.num_processes))
        builder = with_text_metrics(builder, text_source.tokens_per_byte)
    builder = objective.builder(builder, resolved)  # DPO's, GRPO's loss and metrics
    with phase("model"):
        model = build_model(resolved, cluster, builder, objective=objective)
    if trains and cluster.is_chief:  # the record first: a run with a kept model has one
        frozen_base.record(resolved.model, workdir, checkpointed)
        models.preset_copy.keep(resolved.model, workdir)
    if compile_counter is not None:
        compile_cache.keep_steps(model, compile_counter, resolved)
    if text_source is not None:
        data.text.check_vocabulary(text_source.tokenizer, model.output_shape[-1], resolved.data)
    if not one_device:
        objective.check_model(resolved, model)
    saving = ({"keep": resolved.checkpoint.keep, "asynchronous": resolved.checkpoint.asynchronous}
              if trains else {})
    checkpointer = checkpoint.open_checkpointer(
        workdir, model, cluster, adapters_only=frozen_base.adapters_only(resolved.model), **saving)
    return RunSetup(cluster=cluster, config=resolved, objective=objective, builder=builder,
                    model_kwargs=model_kwargs,
                    model=model, text_source=text_source, checkpointer=checkpointer,
                    compile_counter=compile_counter)


def _on_one_device(config):
    """A copy of `config` whose mesh and cluster are this host's first device."""
    config = config_lib.thawed(config)
    config.mesh.update(slices=1, data=1, fsdp=1, expert=1, model=1)
    config.cluster.update(strategy="one_device", virtual_devices=0)
    return config


def with_text_metrics(builder, tokens_per_byte: float):
    """A language model's builder on packed text: bits per token and bits per byte (the
    headline), whatever the tokenizer."""
    from tpu_keras.models.metrics import bits_per_byte, bits_per_token_metric
    return dataclasses.replace(builder, headline="bits_per_byte", metrics=lambda: [
        bits_per_token_metric(), bits_per_byte(tokens_per_byte)])


def build_model(config, cluster, builder=None, objective=None):
    """The config's model on `cluster`, with its layout rules checked, compiled as a run compiles it.

    `builder` replaces the registry's for `config.model` (packed text's metrics:
    `with_text_metrics`; DPO's and GRPO's losses). `objective` (default: the config's)
    wraps the model as it trains: DPO's pairs model, GRPO's group model; where it holds
    a reference (`PolicyWrapper`), that is, without LoRA layers, a second, frozen copy of
    the model, made here with the model's layout and starting weights.

    On jax this first sets the process's `keras.distribution` from the
    model's layout rules, so that Keras lays each weight out as it creates
    it; on tf every weight is replicated and the rules are only checked.
    """
    from tpu_keras import models
    from tpu_keras.models import chunked_loss
    from tpu_keras.training import optimization
    if builder is None:
        builder, _ = models.registry.get(config.model)
    placer = models.registry.placer(config.model, config.layout, cluster.mesh)
    if cluster.engine == "jax":
        from tpu_keras.parallelism import distribution
        distribution.set_layout(cluster, placer)
    with cluster.scope():
        model = models.build(config.model, remat=config.train.remat)
    if chunked_loss.attach(model, config.train.loss_chunks):
        logging.info("loss: the output head and cross-entropy in %d pieces of the sequence",
                     config.train.loss_chunks)
    if cluster.engine == "jax":
        from tpu_keras.models import context_attention, splash_attention
        if routed := context_attention.route(model, cluster.mesh):  # splash's fallback, where routed
            logging.info("attention: each sequence split %d ways over context, keys and values "
                         "gathered in %d layers", cluster.mesh["context"], routed)
        if routed := splash_attention.route(model, cluster):
            logging.info("attention: the TPU's fused kernel (splash) in %d layers", routed)
        if config.layout.sequence_parallel:
            from tpu_keras.models import sequence_parallel
            logging.info("the residual stream split along the sequence over model, at %d blocks' "
                         "outputs", sequence_parallel.apply(model))
    placer.check(model.weights)
    objective = objective or objectives.of(config)
    reference = None
    if objective.holds_reference(config):
        from tpu_keras.models import lora
        if not lora.adapted_layers(model):  # a full fine-tune
            reference = _frozen_copy(config, cluster, model)
            logging.info("%s reference: a frozen copy of the model's %s starting weights",
                         objective.name.upper(), f"{reference.count_params():,}")
    model = objective.wrap(model, reference, config)
    optimization.compile_model(model, builder, config.train, cluster)
    return model


def _frozen_copy(config, cluster, model):
    """A second model of the config, laid out as `model` and holding its weights."""
    import keras
    from tpu_keras import models
    with cluster.scope():
        reference = models.build(config.model, remat=config.train.remat)
        for copy, weight in zip(reference.weights, model.weights):
            copy.assign(keras.ops.copy(weight.value))  # a buffer of its own (jax donates)
    return reference


def model_line(model, config) -> str:
    """The model line of the log: name, parameters (and how many train, when some are
    frozen), precision, steps per execution, and what changes how a step runs."""
    train_cfg, total = config.train, model.count_params()
    trainable = sum(math.prod(v.shape) for v in model.trainable_variables)
    parts = [f"{config.model.name} with {total:,} parameters"
             + (f", {trainable:,} of them trainable ({trainable / max(total, 1):.1%})"
                if trainable != total else ""),
             train_cfg.precision, f"{train_cfg.steps_per_execution} steps per execution"]
    if model.jit_compile:
        parts.append("XLA")
    if train_cfg.remat != "none":
        parts.append(f"remat {train_cfg.remat}")
    if train_cfg.grad_accum_steps > 1:
        parts.append(f"{train_cfg.grad_accum_steps} micro-batches of {train_cfg.batch_size} per update")
    if (objective := objectives.of(config)).name != "sft":
        parts.append(f"objective {objective.name}")
    return ", ".join(parts)
