"""Fine-tune a pretrained causal LM from a transformers checkpoint, and export it.

    python -m tpu_keras.train --config=configs/finetune.py --workdir=gs://bucket/run \
        --config.model.preset=gs://bucket/Meta-Llama-3-8B --config.data.text.files='gs://bucket/data/*.jsonl'

`model.preset` is a transformers-format folder (config.json with `model_type`,
model.safetensors, tokenizer.json; local or gs://), a keras-hub preset folder,
or a handle (`hf://meta-llama/Meta-Llama-3-8B`, `kaggle://...`) where there is
a network. The data are read with the checkpoint's own tokenizer
(`data.tokens.tokenizer='preset'`). At the end DIR/export/ holds a keras-hub preset,
a transformers folder and, for LoRA, lora.weights.h5 and a PEFT adapter (docs/fine_tuning.md).

Variants: '' (LoRA as PEFT defines it, rank 16 and alpha 32 on q_proj and
v_proj, tensor parallel over 8 chips: an 8B Llama 3 on a v5e-8 at 512 tokens
and a batch of 2; `plan` allows up to 7; `--config.model.lora_targets=all-linear`
adapts every projection) and 'full' (every weight trains, split over fsdp as
well: a larger slice for 8B).
"""

from tpu_keras.config import defaults


def get_config(arg=None):
    config = defaults()
    config.engine = "jax"
    config.model = dict(name="keras_hub:Llama3CausalLM", preset="", lora_rank=16, lora_alpha=32,
                        lora_targets="q_proj,v_proj", context_length=512)
    config.data.text.field = "text"  # each .jsonl line's text; data.text.files: the user's
    config.data.tokens.tokenizer = "preset"
    config.mesh.update(data=1, fsdp=1, model=8)
    config.train.update(batch_size=2, steps=1000, learning_rate=2e-4, warmup_steps=50,
                        precision="mixed_bfloat16", remat="activations", eval_every=200)
    config.checkpoint.every_steps = 200
    if arg == "full":
        config.model.lora_rank = 0
        config.mesh.update(data=1, fsdp=2, model=4)
        config.train.learning_rate = 2e-5
    elif arg not in (None, ""):
        raise ValueError(f"unknown variant {arg!r} of finetune; use '' or 'full'")
    return config
