"""What `model.quantize` costs a trained model: its validation loss in float, int8 and int4.

    python scripts/quantization_quality.py --workdir=DIR [--block_sizes=-1,64,128] [--eval_steps=N]
    python scripts/quantization_quality.py --config=FILE --preset=FOLDER

DIR is a finished run of `python -m tpu_keras.train`; nothing is trained here.
The guide's table is of `configs/llama_stdlib.py` trained for its full schedule
first (`python -m tpu_keras.train --config=configs/llama_stdlib.py --workdir=DIR`).
The base is the run's own keras-hub export, DIR/export/keras_hub; `--preset`
names another (DIR/export/transformers where the run wrote one, or a checkpoint
of your own: a keras-hub preset or a transformers folder). With
`--config=FILE[:ARG]` instead of a run, that file's data, batch and model name
are used with `--preset`, and its `model.*` architecture keys are dropped: the
preset describes the model.

Each row builds the base as a quantized LoRA run builds it (`model.quantize`,
jax engine): float, int8 (a scale per output feature), then int4 for each of
`--block_sizes` (-1: a scale per output feature; N: groups of N input
features). A quantized base takes LoRA alone (`models.quantized.check`), so
every row carries a LoRA of rank 1, whose update starts at zero: the logits
are the base's. Every row evaluates the same batches of the eval split
(`train.eval_steps` of them, or `--eval_steps`), one row after another in
this process. Each row also gives its projections' kernel error,
|quantized - float| / |float| over all of them (the loss moves with it, not
in step).
Prints a markdown table, then the figures as one line of JSON.
"""

# Imported inside functions: Keras and the toolkit's data and models (the engine must be
# selected first: engine.select, which `main` calls).
import json
import math
import os
import tempfile

from absl import flags
from ml_collections import config_flags
import numpy as np

from tpu_keras import cli, config as config_lib, data_section, objectives, workdir as workdir_lib
from tpu_keras.cluster import engine
from tpu_keras.errors import UserError
from tpu_keras.training import setup

_WORKDIR = flags.DEFINE_string("workdir", "", "A finished run's folder (its config.json, DIR/export).")
_CONFIG = config_flags.DEFINE_config_file("config", None, "Instead of --workdir: a config file "
                                          "whose data and model name are used with --preset.")
_PRESET = flags.DEFINE_string("preset", "", "The base to quantize; default: DIR/export/keras_hub.")
_BLOCKS = flags.DEFINE_list("block_sizes", ["-1", "64", "128"], "int4's rows: -1 for a scale per "
                            "output feature, N for groups of N input features.")
_KERNEL_ERROR = flags.DEFINE_boolean("kernel_error", True, "Also the quantized projections' "
                                     "error, which holds their float kernels in host memory "
                                     "(float32) meanwhile: --nokernel_error for a model too large.")
_EVAL_STEPS = flags.DEFINE_integer("eval_steps", None, "Eval batches per row; default: the "
                                   "config's train.eval_steps (0: the whole eval split).")

# The model.* keys that are not the architecture's, which the preset gives.
MODEL_KEYS = ("name", "imports", "context_length", "layout_map", "example_end_token")


def rows(block_sizes) -> list:
    """(name, model.quantize, model.quantize_block_size) of each row."""
    made = [("float", "", 0), ("int8", "int8", 0)]
    for block in block_sizes:
        made.append((f"int4, {'one scale per output feature' if block == -1 else f'groups of {block}'}",
                     "int4", block))
    return made


def row_config(config, preset: str, quantize: str, block: int, eval_steps: int):
    """`config` for one row: the base from `preset`, quantized as `quantize` says, under a
    LoRA of rank 1 (its update zero), on the jax engine."""
    row = config_lib.thawed(config)
    kept = {key: row.model[key] for key in MODEL_KEYS if key in row.model}
    row.model = dict(kept, preset=preset, lora_rank=1, quantize=quantize,
                     quantize_block_size=block)
    row.engine = "jax"
    row.train.eval_steps = eval_steps
    return row


def evaluate(config, kernels: bool) -> dict:
    """The row's metrics on the eval split, its batches and the tokens predicted in them
    (every position: packed text's padded end, which weighs 0, counts too); with `kernels`,
    its projections' kernels."""
    from tpu_keras import data
    with tempfile.TemporaryDirectory() as workdir:  # the job's own: nothing is written to the run
        run = setup.set_up(config, workdir)
        eval_data, steps = data.build(run.config.data, run.cluster, run.config.train.batch_size,
                                      training=False, max_eval_steps=run.config.train.eval_steps)
        metrics = run.model.evaluate(eval_data, steps=steps, return_dict=True, verbose=0)
        tokens = steps * run.config.train.batch_size * int(run.model.input_shape[1])
    return {"metrics": {f"val_{name}": float(value) for name, value in metrics.items()},
            "batches": steps, "tokens": tokens,
            "kernels": projection_kernels(run.model) if kernels else None}


def projection_kernels(model) -> list:
    """The float kernels of the projections `model.quantize` quantizes, dequantized where
    they are quantized, in the model's order."""
    import keras
    from tpu_keras.models import export, families, quantized
    backbone = export.find_task(model).backbone
    layers = quantized.projections(backbone, families.of_backbone(type(backbone)).lora_targets)
    return [quantized.float_kernel(layer) if quantized.is_quantized(layer)
            else np.asarray(keras.ops.convert_to_numpy(layer.kernel), "float32") for layer in layers]


def kernel_error(kernels: list, floating: list) -> float:
    """|quantized - float| / |float| over every projection's kernel together (Frobenius)."""
    error = sum(float(np.sum(np.square(k - f))) for k, f in zip(kernels, floating))
    return math.sqrt(error / sum(float(np.sum(np.square(f))) for f in floating))


def measure(config, preset: str, block_sizes, eval_steps: int, kernels: bool = True) -> dict:
    """Every row's metrics, over the same batches; with `kernels`, the quantized kernels'
    error against the float row's."""
    import keras
    results, shape, floating = [], None, None
    for name, quantize, block in rows(block_sizes):
        done = evaluate(row_config(config, preset, quantize, block, eval_steps), kernels)
        shape = shape or (done["batches"], done["tokens"])
        if (done["batches"], done["tokens"]) != shape:
            raise UserError(f"row {name!r} evaluated {done['batches']} batches, the first {shape[0]}")
        result = {"name": name, "quantize": quantize or "float",
                  "block_size": block if quantize == "int4" else None, **done["metrics"]}
        if kernels:
            floating = floating or done["kernels"]
            result["kernel_error"] = kernel_error(done["kernels"], floating)
        results.append(result)
        del done
        keras.backend.clear_session(free_memory=True)
    for result in results:
        result["loss_increase"] = result["val_loss"] - results[0]["val_loss"]
    return {"base": preset, "batches": shape[0], "batch_size": config.train.batch_size,
            "tokens": shape[1], "rows": results}


def table(report: dict) -> str:
    """The rows as a markdown table."""
    first = report["rows"][0]
    extra = [key for key in first if key.startswith("val_") and key != "val_loss"]
    extra += ["kernel_error"] if "kernel_error" in first else []
    lines = ["| base | val_loss | loss - float's | " + " | ".join(extra) + " |",
             "| --- | --- | --- |" + " --- |" * len(extra)]
    for row in report["rows"]:
        figures = [f"{row['val_loss']:.4f}", f"{row['loss_increase']:+.4f}"]
        figures += [f"{row[key]:.4f}" for key in extra]
        lines.append(f"| {row['name']} | " + " | ".join(figures) + " |")
    lines.append(f"\n{report['batches']} batches of {report['batch_size']}: "
                 f"{report['tokens']:,} predicted tokens per row.")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {argv[1:]}")
    if bool(_WORKDIR.value) == bool(_CONFIG.value):
        raise UserError("give --workdir=DIR (a finished run) or --config=FILE with --preset=FOLDER")
    if _CONFIG.value and not _PRESET.value:
        raise UserError("--config needs --preset=FOLDER: the trained model to quantize")
    try:
        blocks = [int(block) for block in _BLOCKS.value]
    except ValueError:
        raise UserError(f"--block_sizes={','.join(_BLOCKS.value)}: give whole numbers, such as "
                        "-1,64,128") from None
    config = config_lib.read_run_config(_WORKDIR.value) if _WORKDIR.value else _CONFIG.value
    objective = objectives.of(config)
    if objective.name != "sft":  # DPO's pairs, GRPO's prompts: no eval text to take a loss on
        raise UserError(f"the config reads data.{data_section.kind(config.data)} "
                        f"({objective.name.upper()}), and this "
                        "measures a language model's loss on eval text: give the config of a "
                        "supervised run of the same model with --config and --preset")
    engine.select("jax", config.cluster.virtual_devices)  # every row's, before Keras loads
    cli.own_info_only()
    preset = _PRESET.value or os.path.join(_WORKDIR.value, "export", "keras_hub")
    if not workdir_lib.is_remote(preset) and not os.path.isdir(preset):
        raise UserError(f"{preset} is not a folder; give --preset=FOLDER, or write the run's "
                        f"export: python -m tpu_keras.export --workdir={_WORKDIR.value}")
    eval_steps = config.train.eval_steps if _EVAL_STEPS.value is None else _EVAL_STEPS.value
    report = measure(config, preset, blocks, eval_steps, _KERNEL_ERROR.value)
    print(table(report))
    print(json.dumps(report), flush=True)
    cli.exit_at_once(0)


if __name__ == "__main__":
    cli.start(main)
