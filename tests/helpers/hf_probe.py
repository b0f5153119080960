"""Transformers checkpoints in, exports out, for every family, on one engine and mesh.

    python tests/helpers/hf_probe.py ENGINE OUT_DIR DATA_DIR DATA,FSDP,MODEL [NAME:RUN,...] [NAME,...] [lean]

For each checkpoint of tests/helpers/hf_checkpoints.py (Llama 3, Llama 3.1 in both
config forms, Qwen 2, Gemma, Mistral), or those named last, where given (these
may also name the checkpoints transformers' save_pretrained writes,
tests/helpers/hf_pretrained.py: Qwen 3, SmolLM3, Gemma 3):
writes it, builds the toolkit's model from it (`model.preset`) on the mesh
and compares its logits before any step with transformers' own
`AutoModelForCausalLM`'s (float32).

For `llama` (on tf) and the save_pretrained checkpoints with an `export` run, the
model `python -m tpu_keras.generate --preset=FOLDER` samples from
(`generation.from_preset`) is compared with transformers' too: where the tests read it.

The runs: `NAME:export` exports that model (`transformers` format alone),
compares the exported config.json with the checkpoint's, and reads the
export with transformers and with the toolkit; `NAME:theta` does the same
with `model.rope_max_wavelength` set over the checkpoint's; `NAME:lora`
(LoRA rank 4 on q_proj and v_proj), `NAME:lora_all` (on 'all-linear', with
rsLoRA's scaling) and
`NAME:full` train through `tpu_keras.training.loop.train` and reload each of
DIR/export/'s formats (keras-hub from the preset, transformers and the
toolkit from the transformers folder, the base checkpoint plus
lora.weights.h5 where keras-hub's loader can read it, PEFT's `PeftModel` of
the base checkpoint plus DIR/export/peft; and the adapter as a run from a
keras-hub preset writes it, on the base it then writes, DIR/export/peft_base;
for tests/helpers/hf_checkpoints.py's, whose tests read them, also the toolkit's read of
the transformers folder, keras-hub's refused LoRA file and the written base alone).
`NAME:instruct` fully fine-tunes on instruction pairs of very different
lengths (packed apart, so several to a row) and compares `evaluate`'s loss
with the mean over the same response tokens of transformers' model of the
transformers export, each pair run alone. A LoRA run also counts its
trainable parameters against PEFT's
`get_peft_model` on the checkpoint, for q_proj,v_proj and for 'all-linear'.
With `lean` last, a LoRA run checks its run, its keras-hub and transformers
exports, its PEFT adapter and its own targets' count alone (what
tests/test_moe_families_on_expert_meshes.py reads): no 'all-linear' model, no
keras-hub LoRA file, no second PEFT export from a keras-hub start.
Reloads are read in host memory, with no distribution.
Families without layout rules of the toolkit's (Qwen, Gemma) fold `model`
into `fsdp`. Prints one line, `HF {json}`: the largest absolute logit
differences (and `scale`, transformers' largest logit) and the config keys
that differ, by checkpoint and check.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json
import os
import sys

engine_name, out, data_dir, mesh = sys.argv[1:5]
runs = sys.argv[5].split(",") if len(sys.argv) > 5 and sys.argv[5] else []  # 'llama:lora', ...
names = sys.argv[6].split(",") if len(sys.argv) > 6 and sys.argv[6] else None  # 'llama', 'gemma', ...
lean = sys.argv[7:] == ["lean"]

from tpu_keras.cluster import engine  # noqa: E402

engine.select(engine_name)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import tpu_keras  # noqa: E402
from tpu_keras import config as config_lib  # noqa: E402
from tpu_keras.config import defaults  # noqa: E402
from tpu_keras.data import text  # noqa: E402
from tpu_keras.models import export, families, hub_presets, segments  # noqa: E402
from tpu_keras.tools import generation  # noqa: E402
from tpu_keras.training import evaluation, loop, setup  # noqa: E402

import hf_checkpoints  # noqa: E402  (beside this script: its folder is sys.path[0])
import hf_pretrained  # noqa: E402

TASKS = {"llama": "Llama3CausalLM", "qwen2": "QwenCausalLM", "gemma": "GemmaCausalLM",
         "mistral": "MistralCausalLM"}


def task_name(name: str) -> str:
    if name in hf_pretrained.TASKS:
        return hf_pretrained.TASKS[name]
    return TASKS[hf_checkpoints.CHECKPOINTS[name][0]]


def write_checkpoint(folder: str, name: str) -> None:
    (hf_pretrained if name in hf_pretrained.TASKS else hf_checkpoints).write(folder, name)


# Keys of a config.json that describe its files rather than the model.
FILE_KEYS = ("torch_dtype", "dtype", "transformers_version")
PEFT_KEYS = ("peft_type", "task_type", "r", "lora_alpha", "use_rslora", "target_modules", "bias",
             "lora_dropout", "fan_in_fan_out", "inference_mode", "target_parameters")
tokens = np.random.default_rng(0).integers(0, 256, (4, 64)).astype("int32")


def forward(model, inputs):
    """`model(inputs)` in float32, compiled whole on jax (`jax.jit` of `stateless_call`;
    `predict_on_batch` would run a keras-hub task's preprocessor first): called eagerly
    there, each operation compiles on its own, and Qwen 3.5's chunked Gated DeltaNet alone
    took a minute of XLA compiles per model."""
    if engine_name == "jax":
        import jax
        trainable = [v.value for v in model.trainable_variables]
        frozen = [v.value for v in model.non_trainable_variables]
        value, _ = jax.jit(model.stateless_call)(trainable, frozen, inputs)
    else:
        value = model(inputs)
    return keras.ops.convert_to_numpy(keras.ops.cast(value, "float32"))


def logits(task):
    return forward(task, segments.task_inputs(task, keras.ops.convert_to_tensor(tokens)))


def gap(a, b):
    return float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(b, "float64"))))


def transformers_logits(folder, adapter=None):
    return hf_checkpoints.transformers_logits(folder, tokens, adapter)


def config_differences(folder, checkpoint):
    """{key: [checkpoint's, export's]} for each key of the checkpoint's config.json that the
    exported one does not keep."""
    with open(os.path.join(folder, "config.json")) as file:
        exported = json.load(file)
    with open(os.path.join(checkpoint, "config.json")) as file:
        source = json.load(file)
    return {key: [value, exported.get(key)] for key, value in source.items()
            if key not in FILE_KEYS and exported.get(key) != value}


# The LoRA runs' targets, in PEFT's names.
LORA_TARGETS = {"lora": "q_proj,v_proj", "lora_all": "all-linear"}
# A `NAME:lora` run of these also adapts the experts' stacked weights (PEFT's target_parameters).
EXPERT_PARAMETERS = {name: "mlp.experts.gate_up_proj,mlp.experts.down_proj"
                     for name in ("gpt_oss", "qwen3_moe", "qwen3_5_moe_text")}


def config_for(name, checkpoint, lora_rank=0, lora_targets="", quantize="", **backbone):
    config = defaults()
    config.engine = engine_name
    config.data.update(preprocess="next_token", data_dir=data_dir)
    config.data.tfds.name = "stdlib_bytes/ctx64"
    config.model = dict(name=f"keras_hub:{task_name(name)}", preset=checkpoint, context_length=64,
                        **backbone)
    if lora_rank:  # every projection with rsLoRA's scaling, lora_alpha / sqrt(r)
        config.model.update(lora_rank=lora_rank, lora_targets=lora_targets,
                            lora_rslora=lora_targets == LORA_TARGETS["lora_all"])
    experts = EXPERT_PARAMETERS.get(name, "") if lora_targets == LORA_TARGETS["lora"] else ""
    if lora_rank and experts:
        config.model.lora_target_parameters = experts
    if quantize:
        config.model.quantize = quantize
    data, fsdp, model, *expert = (int(n) for n in mesh.split(","))
    if families.of_backbone(getattr(keras_hub.models, task_name(name)).backbone_cls).layout is None:
        fsdp, model = fsdp * model, 1
    config.mesh = dict(data=data, fsdp=fsdp, model=model, **({"expert": expert[0]} if expert else {}))
    config.layout.replicate_below = 256
    keras_hub_file = ("lora",) if lora_targets == LORA_TARGETS["lora"] and not experts and not lean else ()  # q, v
    config.export.formats = ("keras_hub", "transformers") + (("peft",) + keras_hub_file if lora_rank else ())
    config.train.update(batch_size=8, steps=4, warmup_steps=1, learning_rate=1e-2, eval_every=100,
                        eval_steps=1, steps_per_execution=2)
    config.checkpoint.every_steps = 4
    config.log.every_steps = 2
    return config


def build(config):
    cluster = tpu_keras.connect(config.cluster, engine=engine_name, mesh=config.mesh)
    return setup.build_model(config, cluster)


def read_back(name, folder, lora=None):
    """The task the toolkit reads from a transformers folder (`hub_presets.load_backbone`, as
    a run's model.preset), with the LoRA factors in `lora` if given, in host memory (no
    distribution: the export's own host copy's scope), its Gated DeltaNet layers in the
    toolkit's rule as a run's are. keras-hub's own reader would drop Llama's rms_norm_eps."""
    task_cls = getattr(keras_hub.models, task_name(name))
    with export._on_host():
        backbone = hub_presets.load_backbone(task_cls.backbone_cls, folder)
        segments.route_delta_nets(backbone)
        task = task_cls(backbone=backbone, preprocessor=None)
        if lora:
            task.backbone.load_lora_weights(lora)
        return task


def peft_trainable(name, checkpoint, targets):
    """PEFT's own count of trainable parameters: LoRA rank 4 on the checkpoint (and on the
    experts' stacked weights where the toolkit's run adapts them, `EXPERT_PARAMETERS`)."""
    import peft
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    experts = EXPERT_PARAMETERS.get(name, "") if targets == LORA_TARGETS["lora"] else ""
    targets = targets if targets == "all-linear" else targets.split(",")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                      target_parameters=experts.split(",") if experts else None))
    return lora.get_nb_trainable_parameters()[0]


def toolkit_trainable(name, checkpoint, targets, model=None):
    """The toolkit's count: of `model`, the run's own with these targets, where given."""
    model = model or build(config_for(name, checkpoint, 4, targets))
    return sum(int(np.prod(w.shape)) for w in model.trainable_weights)


def exported(model, config, folder, checkpoint, expected, name):
    """Exports `model` in the transformers format alone, and reads it back with transformers
    and with the toolkit."""
    problems = export.write(model, config, folder, ("transformers",))
    return {"problems": problems, "config": config_differences(f"{folder}/transformers", checkpoint),
            "torch": gap(expected, transformers_logits(f"{folder}/transformers")),
            "toolkit": gap(expected, logits(read_back(name, f"{folder}/transformers")))}


def instruct(name, checkpoint, workdir):
    """`evaluate`'s loss on instruction pairs packed apart, after a few steps of full
    fine-tuning, against transformers' model of the export, each pair alone."""
    os.makedirs(workdir, exist_ok=True)
    pairs = os.path.join(workdir, "pairs.jsonl")
    with open(pairs, "w") as lines:  # 20 to 59 bytes: a row of 65 holds one to three
        for i in range(40):
            lines.write(json.dumps({"prompt": f"def f{i}(x):" + " #" * (i % 4),
                                    "response": " return x" + " + 1" * (i * 5 % 9)}) + "\n")
    config = config_for(name, checkpoint)
    config.data.update(preprocess="")  # bytes: ids the checkpoint's embedding holds
    config.data.tfds.name = ""
    config.data.instructions.update(files=pairs, eval_files=pairs)
    config.export.formats = ("transformers",)
    config.train.eval_steps = 0  # every row
    loop.train(config, workdir)
    resolved = config_lib.read_run_config(workdir)
    loss = evaluation.evaluate(resolved, workdir)[config.train.steps]["val_loss"]
    source = text.open_source(resolved.data, training=False)
    import torch
    import transformers
    exported = transformers.AutoModelForCausalLM.from_pretrained(f"{workdir}/export/transformers",
                                                                 dtype=torch.float32)
    total = weight = 0.0
    end, rows = source.tokenizer.eos_id, 0
    for row, ids in source.read(source.files, True, with_ids=True).as_numpy_iterator():
        rows += 1
        real = int((ids[:, 0] >= 0).sum())  # the padding after the last pair has id -1
        cuts = [0] + [i + 1 for i in np.flatnonzero(row["tokens"][:real] == end)]
        for a, b in zip(cuts, cuts[1:]):  # each pair alone
            tokens, mask = row["tokens"][a:b], row["mask"][a:b]
            with torch.no_grad():
                logits = exported(torch.tensor(tokens[None, :-1], dtype=torch.long)).logits[0].numpy()
            logits = logits.astype("float64")
            top = logits.max(-1, keepdims=True)
            log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
            nll = -np.take_along_axis(log_probs, tokens[1:, None], -1)[:, 0]
            total, weight = total + (nll * mask[1:]).sum(), weight + mask[1:].sum()
    return {"evaluate": loss, "transformers": total / weight, "rows": rows, "pairs": 40}


def quantized_run(name, checkpoint, mode, first, tokens):
    """A LoRA run over a base quantized to `mode`: its logits before training against the float
    model's (the quantization error), its losses, its merged export read by transformers, and
    its PEFT adapter on the float checkpoint."""
    config = config_for(name, checkpoint, 4, LORA_TARGETS["lora"], quantize=mode)
    per_feature = {}
    if mode == "int4":  # in groups of 16 of the tiny model's 32 or 64 input features
        config.model.quantize_block_size = -1
        per_feature["before_per_feature"] = gap(forward(build(config), tokens), first)
        config.model.quantize_block_size = 16
    untrained = build(config)
    config.train.update(steps=16, learning_rate=3e-2)  # long enough for the loss to fall
    config.checkpoint.every_steps = 16
    quantized = [w for w in untrained.weights if w.path.endswith("/kernel") and "int8" in str(w.dtype)]
    scales = [w for w in untrained.weights if w.path.endswith(("/kernel_scale", "/kernel_zero"))]
    before = forward(untrained, tokens)
    workdir = os.path.join(out, name, f"lora_{mode}")
    history = loop.train(config, workdir)
    trained = history.model
    expected = forward(trained, tokens)
    folder = os.path.join(workdir, "export")
    with open(f"{folder}/peft/adapter_config.json") as file:
        adapter = json.load(file)
    split = lambda weights: sum(len(set(w.value.sharding.device_set)) > 1 and
                                not w.value.sharding.is_fully_replicated for w in weights)
    return {"quantized_kernels": len(quantized), "split_quantized": split(quantized),
            "scales": len(scales), "split_scales": split(scales), **per_feature,
            "before": gap(before, first), "scale": float(np.max(np.abs(first))),
            "losses": [float(x) for x in history.history["loss"]],
            "moved": gap(expected, before),
            "torch": gap(expected, transformers_logits(f"{folder}/transformers")),
            "peft_base_is_the_checkpoint": adapter["base_model_name_or_path"] == checkpoint,
            "peft": gap(expected, transformers_logits(checkpoint, f"{folder}/peft"))}


def load_balancing(model, checkpoint):
    """The router's load-balancing loss of a training call, the toolkit's (the MoE layers'
    added losses over the family's coefficient) and transformers' `load_balancing_loss_func`
    of its own router logits on the same tokens."""
    import torch
    import transformers
    from tpu_keras.models import moe
    task = export.find_task(model)
    blocks = moe.blocks(task)
    coefficient = moe.ADAPTERS[type(blocks[0]).__name__].coefficient(blocks[0])
    inputs = segments.task_inputs(task, keras.ops.convert_to_tensor(tokens))
    if engine_name == "jax":
        import jax
        def losses(trainable, frozen):
            _, _, added = task.stateless_call(trainable, frozen, inputs, training=True, return_losses=True)
            return sum(added)
        total = jax.jit(losses)([v.value for v in task.trainable_variables],
                                [v.value for v in task.non_trainable_variables])
    else:
        task(inputs, training=True)
        total = sum(task.losses)
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    module = sys.modules[type(reference).__module__]
    with torch.no_grad():
        out = reference(torch.tensor(tokens, dtype=torch.long), output_router_logits=True)
    expected = module.load_balancing_loss_func(out.router_logits, reference.config.num_experts
                                               if hasattr(reference.config, "num_experts") and
                                               not hasattr(reference.config, "num_local_experts")
                                               else reference.config.num_local_experts,
                                               reference.config.num_experts_per_tok)
    return {"toolkit": float(total) / coefficient, "transformers": float(expected), "layers": len(blocks)}


result = {}
for name in names or hf_checkpoints.CHECKPOINTS:
    checkpoint = os.path.join(out, name, "checkpoint")
    write_checkpoint(checkpoint, name)
    config = config_for(name, checkpoint)
    toolkit = build(config)
    first = forward(toolkit, tokens)
    whole = [w.path for w in toolkit.weights  # on a mesh, of those layout.replicate_below splits
             if engine_name == "jax" and w.value.sharding.is_fully_replicated and np.prod(w.shape) >= 256]
    split = [w.path for w in toolkit.weights
             if engine_name == "jax" and not w.value.sharding.is_fully_replicated]
    reference = transformers_logits(checkpoint)
    result[name] = {"first_step": gap(first, reference), "split_weights": len(split), "whole": whole,
                    "split_paths": split,
                    "scale": float(np.max(np.abs(reference)))}
    # generate --preset=FOLDER reads it as a run does (the task and its tokenizer)
    if (name == "llama" and engine_name == "tf") or (name in hf_pretrained.CHECKPOINTS
                                                     and f"{name}:export" in runs):
        result[name]["generate_preset"] = gap(reference,
                                              logits(generation.from_preset(checkpoint).model))
    if f"{name}:export" in runs:
        result[name]["export"] = exported(toolkit, config, os.path.join(out, name, "export"), checkpoint,
                                          first, name)
    task_cls = getattr(keras_hub.models, task_name(name))
    if f"{name}:theta" in runs:  # the run's own rope_theta, where the checkpoint has another
        config = config_for(name, checkpoint, rope_max_wavelength=250000.0)
        changed = build(config)
        expected = forward(changed, tokens)
        result[name]["theta"] = {"moved": gap(expected, first), **exported(
            changed, config, os.path.join(out, name, "theta"), checkpoint, expected, name)}
    if f"{name}:aux" in runs:
        result[name]["aux"] = load_balancing(toolkit, checkpoint)
    if f"{name}:instruct" in runs:
        result[name]["instruct"] = instruct(name, checkpoint, os.path.join(out, name, "instruct"))
    for variant, rank in (("lora", 4), ("lora_all", 4), ("full", 0)):
        if f"{name}:{variant}" not in runs:
            continue
        workdir = os.path.join(out, name, variant)
        targets = LORA_TARGETS.get(variant, "")
        config = config_for(name, checkpoint, rank, targets)
        if name in hf_pretrained.MOE_CHECKPOINTS:  # Qwen 3.5's query and value are in one block of
            config.train.steps = config.checkpoint.every_steps = 16  # two: 4 steps move its loss
            config.log.every_steps = 4                                # less than batches differ
        history = loop.train(config, workdir)
        trained = history.model
        expected = forward(trained, tokens)
        folder = os.path.join(workdir, "export")
        checks = {"moved": gap(expected, first), "losses": [float(x) for x in history.history["loss"]],
                  "keras_hub": gap(expected, logits(task_cls.from_preset(f"{folder}/keras_hub"))),
                  "torch": gap(expected, transformers_logits(f"{folder}/transformers")),
                  "config": config_differences(f"{folder}/transformers", checkpoint),
                  "files": sorted(os.listdir(folder))
                  + [f"keras_hub/{n}" for n in sorted(os.listdir(f"{folder}/keras_hub"))]
                  + [f"transformers/{n}" for n in sorted(os.listdir(f"{folder}/transformers"))]}
        older = name in hf_checkpoints.CHECKPOINTS  # tests/test_hub_transformers.py reads more
        if older:
            checks["transformers"] = gap(expected, logits(read_back(name, f"{folder}/transformers")))
        if rank:
            checks["trainable"] = {which: [toolkit_trainable(name, checkpoint, other, trained if
                                                             other == targets else None),
                                           peft_trainable(name, checkpoint, other)]
                                   for which, other in LORA_TARGETS.items() if not lean or other == targets}
            if variant == "lora" and name not in EXPERT_PARAMETERS and not lean:  # keras-hub's loader: query, value alone
                base = read_back(name, checkpoint, lora=f"{folder}/lora.weights.h5")
                checks["base_plus_lora"] = gap(expected, logits(base))
            if older:
                checks["lora_refused"] = export.write(trained, config_for(name, checkpoint, rank, targets),
                                                      os.path.join(workdir, "lora_file"), ("lora",))
            checks["files"] += [f"peft/{n}" for n in sorted(os.listdir(f"{folder}/peft"))]
            with open(f"{folder}/peft/adapter_config.json") as file:
                adapter = json.load(file)
            checks["peft_base_is_the_checkpoint"] = adapter["base_model_name_or_path"] == checkpoint
            checks["peft"] = gap(expected, transformers_logits(adapter["base_model_name_or_path"],
                                                               f"{folder}/peft"))
            checks["peft_config"] = {key: adapter[key] for key in PEFT_KEYS}
            if lean:
                result[name][variant] = checks
                continue
            # From a keras-hub preset (the run's own export stands in for one), the base has no
            # transformers checkpoint: the export writes it, un-merged, and names it.
            keras_hub_start = config_for(name, checkpoint, rank, targets)
            keras_hub_start.model.preset = f"{folder}/keras_hub"
            elsewhere = os.path.join(workdir, "from_keras_hub")
            checks["peft_problems"] = export.write(trained, keras_hub_start, elsewhere, ("peft",))
            with open(f"{elsewhere}/peft/adapter_config.json") as file:
                written = json.load(file)["base_model_name_or_path"]
            checks["peft_written_base"] = os.path.relpath(written, elsewhere)
            checks["peft_on_written_base"] = gap(expected, transformers_logits(written, f"{elsewhere}/peft"))
            if older:
                checks["written_base_alone"] = gap(first, transformers_logits(written))  # LoRA's base
        result[name][variant] = checks
    for mode in ("int8", "int4"):  # LoRA on q, v over a quantized base (models.quantized)
        if f"{name}:lora_{mode}" in runs:
            result[name][f"lora_{mode}"] = quantized_run(name, checkpoint, mode, first, tokens)


import torch  # noqa: E402
import transformers  # noqa: E402

result["versions"] = f"transformers {transformers.__version__}, torch {torch.__version__}"
print("HF " + json.dumps(result), flush=True)
