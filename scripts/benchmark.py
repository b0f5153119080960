"""Benchmarks, printed as JSON. Quote ratios: absolute numbers drift on a shared machine.

    python scripts/benchmark.py --data
    python scripts/benchmark.py --fit [--modes=one_device,mirrored4]
    python scripts/benchmark.py --run [--run_config=lm_stdlib] [--repeat=2 --run_engine=jax]
    python scripts/benchmark.py --accelerator [--configs=lm_stdlib,lm_stdlib:1b]
    python scripts/benchmark.py --tpu_compile
    python scripts/benchmark.py --tpu_step_overhead
    python scripts/benchmark.py --planner_table
    python scripts/benchmark.py --attention_kernels
    python scripts/benchmark.py --checkpoint
    python scripts/benchmark.py --memory [--memory_size=0.85b]
    python scripts/benchmark.py --moe
    python scripts/benchmark.py --long_context

--run: one whole `python -m tpu_keras.train` run of the default config, on
a dataset prepared beforehand, timed from outside, and where its wall time
went (the run's own DIR/timings.json, plus the process's exit, which only
the outside sees). `outside_steps_fraction` is the share of the wall time
not spent in training steps: start-up, compiling, validation, checkpoints,
export, exit and anything else the toolkit does around the work. With
--repeat=2 it runs twice, on fresh workdirs sharing one fresh compile cache,
and shows both compile figures and their ratio, and the same for each first
execution's whole excess (compile plus warmup: its first batch and first
executions), which is what a restart waits for before its first step.

--fit: the toolkit's `fit` next to plain Keras `fit` on the same model, the
same initial weights and the same batch (one real batch repeated from
memory, so the training loop alone is timed): Keras with its defaults, and
Keras hand-tuned (steps_per_execution=10, jit_compile=True). Plain Keras
runs in a process of its own with TensorFlow's defaults, as its user runs
it (the toolkit changes process-wide settings, such as TensorFlow's CPU
allocator; see benchmark_peer.py), and the two processes take turns. The
turns come in an order where over the rounds each model takes every place
and comes right after each of the others equally often, and each reports
its median and every round's rate, so drift on a shared machine hits all
alike. The float32 and bfloat16 matmul ceilings are measured in the same
run; each result gives examples/s, model FLOP/s (see
tpu_keras.measurement.flops), the fraction of the float32 ceiling, and the
ratios to both peers. Each mode (one device; 4 logical CPU devices under
Mirrored) runs in its own processes, since TensorFlow fixes its devices at
start-up.

--data: for each shipped config (the byte windows of lm_stdlib, the images of
digits, and llama_stdlib:spm's text, tokenized with SentencePiece and packed
inside tf.data), the examples/s its training input pipeline
(one host's tf.data pipeline, pulled inside a tf.function as training pulls
it) produces, next to the examples/s its training step consumes on one
device (one batch repeated from memory, so the step alone is timed). The
ratio says how far the pipeline is from being the bottleneck. The rate
through the strategy's distributed iterator is shown too: that transport is
TensorFlow's, and training pays it as well.

--accelerator: the jax engine next to plain Keras on JAX on this machine's
GPU or TPU, examples/s and MFU against the published peak; one line and
exit 0 where there is none (see accelerator_benchmark.py).

--tpu_compile: `python -m tpu_keras.plan --measure` of the Fine-tuning
guide's 8B Llama 3 LoRA (configs/finetune.py with the 8B architecture as
model.* keys, no checkpoint) on a v5litepod-8, in a process of its own: the
TPU compiler (libtpu) compiles the real training step for the slice's 8
chips on this machine, with nothing allocated. It prints the command's wall
time, the compile time, the process's peak host memory (its maxrss), and
the compiler's figures per device beside the plan's.

--tpu_step_overhead: the toolkit's guarded step (gradient norm, non-finite
check, revert) and its accumulation next to plain Keras's `fit` step for
the same model, batch and mesh on a v5litepod-8, by the TPU compiler's
step-time estimates and HBM peaks (scripts/step_overhead.py says what is
compiled).

--planner_table: `plan --measure` on the TPU compiler for every config of
configs/ on a v5litepod-8, a v5litepod-16, a v5p-64 and two v5litepod-16
slices, in mixed_bfloat16: the plan's memory per device and bytes sent
against the compiler's, with the term that differs most where they part
(planner_table.py).

--attention_kernels: whether keras-hub's Llama attention runs as the TPU's
fused kernel, as Keras runs it and as the toolkit does, on a slice of each
TPU generation under data, fsdp and fsdp x model meshes: the kernel calls
in each compiled program and the HBM peaks (attention_kernels.py).

--checkpoint: how long a save blocks the training loop, synchronous against
asynchronous (`checkpoint.asynchronous`), on each engine, for a model of 300
million parameters with Adam (3.6 GB per checkpoint) saved to local disk by
the toolkit's checkpointers, in turns, with training steps between saves
(checkpoint_saves.py).

--memory: the peak host memory of one LoRA step over a Llama 3 checkpoint of
0.85B parameters in bfloat16, over its float base and over its int8 base,
each a whole run in a process of its own, against the checkpoint's bytes
(memory_benchmark.py; docs/performance.md, "Host memory").

--moe: a training step of one keras-hub Qwen3-MoE block computed sparsely by
the toolkit (`tpu_keras.models.moe`: each expert multiplies its own tokens)
against keras-hub's dense expert bank (every expert on every token), in
turns, at 8 experts with top 2 and at 32 with top 4, with XLA's FLOPs of each
forward layer for this CPU and for a TPU v5e chip (moe_layers.py);
`sparse_over_dense` is the step-time ratio.

--long_context: a training step of a Llama of a 32,768-entry vocabulary on 2
sequences of 2,048 tokens, its head and loss over the whole logits against
`train.loss_chunks=8` (models.chunked_loss), in turns: step times, and the
memory XLA's compiled program needs beyond its arguments, for this CPU and
for one TPU v5e chip (long_context.py); `chunked_over_whole` are the ratios.
"""

import contextlib
import json
import os
import statistics
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "configs"))

import benchmark_peer  # noqa: E402  (beside this script)
import benchmark_timing as timing  # noqa: E402

_DATA = flags.DEFINE_bool("data", False, "Input pipeline rate vs training consumption.")
_FIT = flags.DEFINE_bool("fit", False, "The toolkit's fit vs plain Keras, defaults and hand-tuned.")
_MODES = flags.DEFINE_list("modes", ["one_device", "mirrored4"], "--fit: device layouts to run.")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "--fit: turns each variant gets, in a balanced order "
                                "(benchmark_timing.turn_order); the median counts.")
_MODE = flags.DEFINE_string("one_mode", "", "Internal: run one --fit mode in this process.")
_PEER = flags.DEFINE_string("fit_peer", "", "Internal: serve plain Keras's --fit turns, from "
                            "this handover file (see benchmark_peer.py).")
_CONFIGS = flags.DEFINE_list("configs", ["lm_stdlib", "digits", "llama_stdlib:spm"],
                              "Config modules under configs/, each optionally with :VARIANT.")
_SECONDS = flags.DEFINE_float("seconds", 10.0, "Time spent measuring each rate.")
_RUN = flags.DEFINE_bool("run", False, "A whole training run, timed, and where its time goes.")
_RUN_CONFIG = flags.DEFINE_string("run_config", "lm_stdlib", "--run: a config module under "
                                  "configs/, optionally with :VARIANT.")
_REPEAT = flags.DEFINE_integer("repeat", 1, "--run: runs on fresh workdirs that share one fresh "
                                "compile cache (2: the second loads what the first compiled).")
_RUN_ENGINE = flags.DEFINE_string("run_engine", "tf", "--run with --repeat above 1: tf or jax.")
_ACCELERATOR = flags.DEFINE_bool("accelerator", False, "The jax engine vs plain Keras on JAX on "
                                  "this machine's GPU or TPU (--configs: lm_stdlib,lm_stdlib:1b).")
_ON_CPU = flags.DEFINE_bool("accelerator_on_cpu", False, "--accelerator: run on a CPU too, to "
                            "check the code path (its figures mean nothing).")
_TPU_COMPILE = flags.DEFINE_bool("tpu_compile", False, "The 8B Llama LoRA of the Fine-tuning "
                                  "guide compiled by the TPU compiler for a v5litepod-8 (plan "
                                  "--measure): time and peak host memory.")
_STEP_OVERHEAD = flags.DEFINE_bool("tpu_step_overhead", False, "The toolkit's guarded step and "
                                    "accumulation next to plain Keras's fit step, by the TPU "
                                    "compiler's estimates for a v5litepod-8 (step_overhead.py).")
_PLANNER_TABLE = flags.DEFINE_bool("planner_table", False, "The plan's memory and bytes sent "
                                   "against the TPU compiler's, for every shipped config on four "
                                   "slices (planner_table.py).")
_ATTENTION = flags.DEFINE_bool("attention_kernels", False, "keras-hub's Llama attention as Keras "
                                "and as the toolkit run it, compiled for each TPU generation: "
                                "fused kernel calls and HBM peaks (attention_kernels.py).")
_CHECKPOINT = flags.DEFINE_bool("checkpoint", False, "Blocked seconds per save, synchronous "
                                 "against asynchronous, on both engines.")
_MEMORY = flags.DEFINE_bool("memory", False, "Peak host memory of a LoRA step over a 0.85B Llama 3, "
                            "over its float base and its int8 base (memory_benchmark.py).")
_MEMORY_SIZE = flags.DEFINE_string("memory_size", "0.85b", "--memory: llama_checkpoint.py's size.")
_LONG_CONTEXT = flags.DEFINE_bool("long_context", False, "A long sequence's step with the whole "
                                   "logits against train.loss_chunks: time and temporaries.")
_MOE = flags.DEFINE_bool("moe", False, "The sparse MoE layer's step against keras-hub's dense "
                         "expert bank at 8/2 and 32/4 experts/top-k (moe_layers.py).")
_QUALITY = flags.DEFINE_integer("quality_steps", 200, "--fit: real training steps behind the "
                                "float32 vs mixed_bfloat16 validation loss (0: skip).")


def _rate(run_once, examples_per_call, seconds):
    """Calls `run_once` (after two warm-up calls) for about `seconds`; returns examples/s."""
    run_once()
    run_once()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run_once()
        calls += 1
    return calls * examples_per_call / (time.perf_counter() - start)


def data_benchmark(name, seconds):
    """One config's pipeline rate and training rate on one device, in examples/s."""
    import tensorflow as tf
    import tpu_keras
    from tpu_keras import data
    from tpu_keras.training.setup import build_model

    config = timing.config_by_name(name)
    config.data.tokens.update(data.text.resolve(config))  # packed text: the model's context, its tokenizer
    cluster = tpu_keras.connect({"strategy": "one_device"})
    batch = config.train.batch_size
    host_pipeline, _ = data.pipeline.dataset_fn(config.data, cluster, batch, training=True)
    pipeline_batches = iter(host_pipeline(tf.distribute.InputContext()))
    distributed_batches = iter(data.build(config.data, cluster, batch, training=True)[0])

    @tf.function
    def drain(iterator, count=tf.constant(100)):
        """Pulls `count` batches inside TensorFlow, as a training loop does."""
        for _ in tf.range(count):
            next(iterator)

    def drain_rate(batches):
        return _rate(lambda: drain(batches), 100 * batch, seconds)
    pipeline, distributed = drain_rate(pipeline_batches), drain_rate(distributed_batches)

    # The step alone: one real batch, repeated from memory. The pipelines'
    # iterators go first: their background threads would share the cores.
    cached = tf.data.Dataset.from_tensors(next(pipeline_batches)).repeat()
    del pipeline_batches, distributed_batches
    model = build_model(config, cluster)
    steps = model.steps_per_execution
    training = timing.training_rate(model, cached, batch, seconds)
    return {"config": name, "global_batch": batch, "steps_per_execution": steps,
            "pipeline_examples_per_second": round(pipeline, 1),
            "through_strategy_examples_per_second": round(distributed, 1),
            "training_examples_per_second": round(training, 1),
            "pipeline_over_training": round(pipeline / training, 2)}


# Plain Keras, as a user would compile it: its defaults, and an expert's tuning.
KERAS_VARIANTS = {"keras_defaults": {}, "keras_tuned": {"steps_per_execution": 10, "jit_compile": True}}


def fit_benchmark(mode, names, seconds, rounds, quality_steps):
    """One device layout: every config's variants, in turns; returns result dicts.

    The toolkit's models train here; plain Keras's in a peer process with
    TensorFlow's defaults (benchmark_peer.py), since the toolkit changes
    process-wide settings that a plain-Keras user does not have.
    """
    import tempfile
    import tensorflow as tf
    from tpu_keras.measurement import flops, peak

    cluster = _connect(mode)
    ceilings = {dtype: peak.measure_matmul(dtype, "tf") for dtype in ("float32", "bfloat16")}
    results = []
    for name in names:
        config = timing.config_by_name(name)
        batch = config.train.batch_size
        one_batch = _one_batch(config, cluster)
        ours = {"toolkit": _toolkit_model(config, cluster, "float32"),
                "toolkit_bf16": _toolkit_model(config, cluster, "mixed_bfloat16")}
        initial = ours["toolkit"].get_weights()
        ours["toolkit_bf16"].set_weights(initial)
        with tempfile.TemporaryDirectory() as folder:
            handover = os.path.join(folder, "handover.npz")
            benchmark_peer.hand_over(handover, initial, one_batch)
            peer = benchmark_peer.PlainKerasPeer(mode, name, handover, seconds)
        cached = tf.data.Dataset.from_tensors(one_batch).repeat()
        turns = timing.training_turns(ours, cached, batch, seconds)
        turns.update({variant: (lambda variant=variant: peer.rate(variant)) for variant in KERAS_VARIANTS})
        try:
            rates = timing.race(turns, rounds)
        finally:
            peer.close()
        models = {variant: timing.settings(model) for variant, model in ours.items()}
        models.update(peer.models)
        per_example = flops.training_flops_per_example(ours["toolkit"])
        result = {"mode": mode, "config": name, "global_batch": batch,
                  "flops_per_example": per_example,
                  "ceilings_flops_per_second": {k: float(f"{v:.4g}") for k, v in ceilings.items()}}
        for variant, turns_run in rates.items():
            if isinstance(turns_run, str):
                result[variant] = {"error": turns_run}
                continue
            rate = statistics.median(turns_run)
            result[variant] = {"examples_per_second": round(rate, 1),
                               "each_round": [round(r, 1) for r in turns_run],
                               **models[variant],
                               "model_flops_per_second": float(f"{rate * per_example:.4g}"),
                               "fraction_of_float32_ceiling": round(rate * per_example / ceilings["float32"], 3)}
        for ours_name in ours:
            for peer_name in KERAS_VARIANTS:
                if "examples_per_second" in result[ours_name] and "examples_per_second" in result[peer_name]:
                    result[f"{ours_name}_over_{peer_name}"] = round(
                        result[ours_name]["examples_per_second"] / result[peer_name]["examples_per_second"], 2)
        if quality_steps and mode == "one_device":
            result["bf16_validation"] = _precision_quality(config, cluster, initial, quality_steps)
        results.append(result)
        # Each config's result as soon as it is in: a long run that is cut short keeps them.
        print(f"done: {json.dumps(result)}", file=sys.stderr, flush=True)
    return results


def serve_plain_keras(mode, name, handover, seconds):
    """The peer process of `fit_benchmark`: plain Keras's models, one turn per request."""
    import tensorflow as tf

    cluster = _connect(mode)
    config = timing.config_by_name(name)
    batch_like = _one_batch(config, cluster)  # first: it resolves a text config's model size
    models = _plain_keras_models(config, cluster)
    batch = benchmark_peer.receive(handover, models, batch_like)
    cached = tf.data.Dataset.from_tensors(batch).repeat()
    benchmark_peer.serve(models, timing.training_turns(models, cached, config.train.batch_size, seconds))


def _connect(mode):
    import tpu_keras
    return tpu_keras.connect({"strategy": "one_device"} if mode == "one_device"
                             else {"strategy": "mirrored", "virtual_devices": 4})


def _one_batch(config, cluster):
    """One global training batch of the config's real data."""
    import tensorflow as tf
    from tpu_keras import data

    config.data.tokens.update(data.text.resolve(config))  # packed text: the model's context, its tokenizer
    batch = config.train.batch_size
    host_pipeline, _ = data.pipeline.dataset_fn(config.data, cluster, batch, training=True)
    # The host pipeline yields one replica's share at a time: regroup a global batch.
    return next(iter(host_pipeline(tf.distribute.InputContext()).rebatch(batch)))


def _plain_keras_models(config, cluster):
    """Plain Keras's models, built and compiled as a user would: the toolkit's model
    builder, Keras's own `fit` machinery, with its defaults and hand-tuned."""
    from tpu_keras import models
    from tpu_keras.training import optimization

    builder, kwargs = models.registry.get(config.model)
    variants = {}
    for variant, options in KERAS_VARIANTS.items():
        with cluster.scope():
            model = builder.make(**kwargs)
            model.compile(optimizer=optimization.make_optimizer(config.train), loss=builder.loss(),
                          weighted_metrics=builder.metrics(), **options)
        variants[variant] = model
    return variants


def _toolkit_model(config, cluster, precision):
    """The model `tpu_keras.train` would build and compile, in `precision`."""
    import keras
    from tpu_keras.training.setup import build_model

    keras.config.set_dtype_policy(precision)
    try:
        return build_model(config, cluster)
    finally:
        keras.config.set_dtype_policy("float32")


def _precision_quality(config, cluster, initial, steps):
    """Validation loss after `steps` real training steps in float32 and in
    mixed_bfloat16, from the same weights and batches: what bf16 costs."""
    from tpu_keras import data

    config = config.copy_and_resolve_references()  # the caller's config keeps its steps
    config.train.steps = steps  # the learning-rate schedule decays over these steps
    batch = config.train.batch_size
    eval_batches = config.train.eval_steps or 20
    losses = {}
    for precision in ("float32", "mixed_bfloat16"):
        model = _toolkit_model(config, cluster, precision)
        model.set_weights(initial)
        train, _ = data.build(config.data, cluster, batch, training=True, seed=config.seed)
        evaluation, _ = data.build(config.data, cluster, batch, training=False, max_eval_steps=eval_batches)
        model.fit(train, epochs=1, steps_per_epoch=steps, verbose=0)
        losses[precision] = model.evaluate(evaluation, steps=eval_batches, verbose=0, return_dict=True)["loss"]
    change = losses["mixed_bfloat16"] / losses["float32"] - 1
    return {"steps": steps, "float32_loss": round(losses["float32"], 4),
            "mixed_bfloat16_loss": round(losses["mixed_bfloat16"], 4),
            "relative_change": round(change, 4)}


def run_benchmark(name, extra_args=()):
    """One `python -m tpu_keras.train` run in a fresh process: its wall time and breakdown."""
    import subprocess
    import tempfile
    from tpu_keras.data import offline

    config = timing.config_by_name(name)
    module, _, variant = name.partition(":")
    config_arg = f"configs/{module}.py" + (f":{variant}" if variant else "")
    if config.data.tfds.name:  # prepared first: the benchmark times training, not data preparation
        offline.prepare(config.data.tfds.name, os.path.expanduser(config.data.data_dir))
    with tempfile.TemporaryDirectory() as workdir:
        start = time.time()
        result = subprocess.run([sys.executable, "-m", "tpu_keras.train", f"--config={config_arg}",
                                 f"--workdir={workdir}", *extra_args], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wall = time.time() - start
        if result.returncode:
            raise RuntimeError(f"the run exited {result.returncode}:\n{result.stdout[-3000:]}")
        with open(os.path.join(workdir, "timings.json")) as f:
            inside = json.load(f)
    seconds = dict(inside["seconds"], exit=max(0.0, wall - inside["wall_seconds"]))
    examples = config.train.steps * config.train.batch_size * config.train.grad_accum_steps
    return {"config": config_arg, "steps": config.train.steps, "wall_seconds": round(wall, 1),
            "seconds": {name: round(value, 2) for name, value in seconds.items()},
            "examples_per_second_in_steps": round(examples / seconds["steps"], 1),
            "outside_steps_fraction": round(1 - seconds["steps"] / wall, 3),
            "compile_cache": inside.get("compile_cache", {}).get("note", "")}


def repeated_runs(name, repeat, engine):
    """`repeat` runs of `name` on fresh workdirs sharing one fresh compile cache: what the
    persistent compilation cache saves a rerun, a resume or an evaluation job."""
    import tempfile
    with tempfile.TemporaryDirectory() as cache:
        results = [run_benchmark(name, (f"--config.engine={engine}",
                                        f"--config.train.compile_cache={cache}"))
                   for _ in range(repeat)]
    compiles = [r["seconds"]["compile"] for r in results]
    first_calls = [round(r["seconds"]["compile"] + r["seconds"]["warmup"], 2) for r in results]
    return {"engine": engine, "runs": results, "compile_seconds": compiles,
            "later_compile_over_first": _over_first(compiles),
            "compile_and_warmup_seconds": first_calls,
            "later_compile_and_warmup_over_first": _over_first(first_calls)}


def _over_first(figures):
    return [round(figure / figures[0], 3) if figures[0] else None for figure in figures[1:]]


def _run_modes(modes):
    """Runs each --fit mode in its own process (devices are fixed at start-up); merges the JSON."""
    import subprocess
    results = []
    for mode in modes:
        out = subprocess.run([sys.executable, __file__, "--fit", f"--one_mode={mode}",
                              f"--configs={','.join(_CONFIGS.value)}", f"--seconds={_SECONDS.value}",
                              f"--rounds={_ROUNDS.value}", f"--quality_steps={_QUALITY.value}"],
                             check=True, text=True,
                             stdout=subprocess.PIPE).stdout
        results += json.loads(out)["results"]
    one_device = {r["config"]: r["toolkit"] for r in results if r["mode"] == "one_device"}
    for result in results:  # the cost of replicas sharing one machine's cores
        alone = one_device.get(result["config"], {}).get("examples_per_second")
        if result["mode"] != "one_device" and alone and "examples_per_second" in result["toolkit"]:
            result["toolkit_over_own_one_device"] = round(result["toolkit"]["examples_per_second"] / alone, 2)
    return results


# The Fine-tuning guide's 8B Llama 3 (docs/fine_tuning.md), as model.* keys.
LLAMA3_8B = ("--config.model.vocabulary_size=128256", "--config.model.num_layers=32",
             "--config.model.hidden_dim=4096", "--config.model.intermediate_dim=14336",
             "--config.model.num_query_heads=32", "--config.model.num_key_value_heads=8",
             "--config.model.rope_max_wavelength=500000", "--config.train.batch_size=1")


def tpu_compile_benchmark() -> dict:
    """`plan --measure` of the 8B Llama LoRA on a v5litepod-8, timed from outside, with the
    peak resident memory of its process (`getrusage` of the children: this is the only one)."""
    import resource
    import subprocess
    command = [sys.executable, "-m", "tpu_keras.plan", "--config=configs/finetune.py",
               "--tpu=v5litepod-8", *LLAMA3_8B, "--measure", "--json"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - started
    if done.returncode not in (0, 1):  # 1: it does not fit, which is an answer
        raise SystemExit(f"error: {' '.join(command)} exited {done.returncode}: "
                         f"{done.stderr.strip().splitlines()[-1:]}")
    plan = json.loads(done.stdout)
    m = plan["measured"]
    keep = ("compiler", "jax", "topology", "devices", "arguments", "outputs", "temporaries",
            "program", "peak", "hbm_bytes_per_device", "fits", "share_of_hbm", "step_seconds",
            "flops_per_device", "bytes_accessed_per_device", "model_flops_per_micro_batch", "mfu",
            "mfu_of", "estimate_covers", "out_of_memory", "splash_attention_layers",
            "fused_kernels", "scheduled_peak")
    return {"command": " ".join(command[1:]), "wall_seconds": round(wall, 1),
            "build_seconds": m["seconds"]["build"], "compile_seconds": m["seconds"]["compile"],
            "peak_host_memory_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            "plan_per_device": plan["per_device"],
            "compiler": {key: m[key] for key in keep if key in m},
            "sent_per_step": m.get("sent_per_step"),
            "collectives": m.get("collectives", [])[:5]}


def script_json(script: str, *args: str) -> dict:
    """The JSON a script beside this one prints, from a process of its own (it picks the jax
    engine before Keras loads), with its wall time."""
    import subprocess
    command = [sys.executable, os.path.join(REPO, "scripts", script), *args]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(command)} exited {done.returncode}: "
                         f"{done.stderr.strip().splitlines()[-1:]}")
    return {**json.loads(done.stdout), "wall_seconds": round(time.perf_counter() - started, 1)}


def main(argv):
    del argv
    if _FIT.value and _PEER.value:  # the plain-Keras peer: it replies on stdout
        serve_plain_keras(_MODE.value, _CONFIGS.value[0], _PEER.value, _SECONDS.value)
        return
    report = sys.stdout
    # Only the JSON goes to stdout: what the libraries print on the way (TFDS's "Downloading
    # and preparing dataset ..." on a first run) goes to stderr, so `| python -c json.load`
    # reads the result on any run.
    with contextlib.redirect_stdout(sys.stderr):
        _benchmark(report)
    # Out before the interpreter's teardown: once here, a --repeat run whose two runs had
    # finished exited with nothing printed to a redirected stdout.
    report.flush()


def _benchmark(report):
    def emit(text):
        print(text, file=report)
    if _FIT.value:
        if _MODE.value:
            results = fit_benchmark(_MODE.value, _CONFIGS.value, _SECONDS.value, _ROUNDS.value,
                                    _QUALITY.value)
        else:
            results = _run_modes(_MODES.value)
        emit(json.dumps({"benchmark": "fit", "results": results}, indent=2))
    elif _RUN.value and _REPEAT.value > 1:
        emit(json.dumps({"benchmark": "run", "repeated": repeated_runs(
            _RUN_CONFIG.value, _REPEAT.value, _RUN_ENGINE.value)}, indent=2))
    elif _RUN.value:
        emit(json.dumps({"benchmark": "run", "results": [run_benchmark(_RUN_CONFIG.value)]}, indent=2))
    elif _ACCELERATOR.value:
        import accelerator_benchmark
        configs = _CONFIGS.value if _CONFIGS.present else accelerator_benchmark.DEFAULT_CONFIGS
        result = accelerator_benchmark.measure(configs, _SECONDS.value, _ROUNDS.value,
                                           allow_cpu=_ON_CPU.value)
        emit(json.dumps(result, indent=2) if result else accelerator_benchmark.no_accelerator_line())
    elif _TPU_COMPILE.value:
        emit(json.dumps({"benchmark": "tpu_compile", "result": tpu_compile_benchmark()}, indent=2))
    elif _STEP_OVERHEAD.value:
        emit(json.dumps({"benchmark": "tpu_step_overhead", "result": script_json("step_overhead.py")},
                        indent=2))
    elif _PLANNER_TABLE.value:
        emit(json.dumps({"benchmark": "planner_table", "result": script_json("planner_table.py")},
                        indent=2))
    elif _ATTENTION.value:
        emit(json.dumps({"benchmark": "attention_kernels",
                         "result": script_json("attention_kernels.py")}, indent=2))
    elif _CHECKPOINT.value:
        emit(json.dumps({"benchmark": "checkpoint", "results": [
            script_json("checkpoint_saves.py", engine) for engine in ("tf", "jax")]}, indent=2))
    elif _MEMORY.value:
        emit(json.dumps({"benchmark": "memory", "result": script_json(
            "memory_benchmark.py", f"--size={_MEMORY_SIZE.value}")}, indent=2))
    elif _MOE.value:
        emit(json.dumps({"benchmark": "moe", "result": script_json("moe_layers.py")}, indent=2))
    elif _LONG_CONTEXT.value:
        emit(json.dumps({"benchmark": "long_context", "result": script_json("long_context.py")}, indent=2))
    elif _DATA.value:
        results = [data_benchmark(name, _SECONDS.value) for name in _CONFIGS.value]
        emit(json.dumps({"benchmark": "data", "results": results}, indent=2))
    else:
        raise app.UsageError("choose a benchmark: --data, --fit, --run, --accelerator, "
                             "--tpu_compile, --checkpoint, ...")


if __name__ == "__main__":
    app.run(main)
