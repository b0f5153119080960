"""A small Llama (keras-hub's LlamaBackbone) on the Python standard library's own source, offline.

    python -m tpu_keras.train --config=configs/llama_stdlib.py --workdir=/tmp/llama
    python -m tpu_keras.train --config=configs/llama_stdlib.py:tiny --workdir=/tmp/llama_tiny
    python -m tpu_keras.train --config=configs/llama_stdlib.py:lora --workdir=/tmp/llama_lora
    python -m tpu_keras.train --config=configs/llama_stdlib.py:spm --workdir=/tmp/llama_spm

Needs the 'hub' extra (pip install -e ".[hub]"). The Llama architecture
(rotary positions, grouped-query attention, SwiGLU, RMS norm) with a byte
vocabulary, trained from scratch on the same data, steps and batch as
configs/lm_stdlib.py's gpt, so the two compare on validation bits per byte.

Variants: '' (a few minutes on a 2-core CPU), 'tiny' (seconds; for tests)
and 'lora' (the tiny model fine-tuned with LoRA rank 4 from a preset: the
run first saves a freshly initialised backbone to DIR/base_preset, an
offline stand-in for a downloaded preset; point model.preset at a real one).
'spm' is the default model with a 1,024-piece SentencePiece vocabulary read
by keras-hub's LlamaTokenizer, on the standard library as .txt documents
(tpu_keras.data.stdlib_text writes both under data.data_dir on first use),
tokenized and packed; it reports bits per byte like the byte-level models.
'spm_tiny' is the same path at the tiny model's size.
"""

from tpu_keras.config import defaults


def get_config(arg=None):
    config = defaults()
    config.data.tfds.name = "stdlib_bytes/ctx128"
    config.data.preprocess = "next_token"
    config.model = dict(name="keras_hub:LlamaCausalLM", context_length=128,
                        vocabulary_size=256, hidden_dim=128, num_layers=2, num_query_heads=4,
                        num_key_value_heads=2, intermediate_dim=256,
                        # "keras_hub": the backbone's own get_layout_map instead (checked)
                        layout_map="toolkit")

    config.train.batch_size = 32
    config.train.steps = 800
    config.train.learning_rate = 3e-3
    config.train.warmup_steps = 50
    config.train.jit_compile = True
    config.train.eval_every = 400
    config.train.eval_steps = 50
    config.checkpoint.every_steps = 200
    config.log.every_steps = 100

    if arg in ("tiny", "lora", "spm_tiny"):  # spm_tiny: the spm branch below replaces data
        config.data.tfds.name = "stdlib_bytes/ctx64"
        config.model.update(context_length=64, hidden_dim=32, num_layers=1, num_query_heads=2,
                            num_key_value_heads=2, intermediate_dim=64)
        config.train.update(batch_size=16, steps=20, warmup_steps=5, eval_every=10,
                            eval_steps=2, steps_per_execution=5, jit_compile=False)
        config.checkpoint.every_steps = 10
        config.log.every_steps = 10
    if arg in ("spm", "spm_tiny"):
        text = "{data_dir}/stdlib_text"  # '{data_dir}': data.data_dir
        config.data.tfds.name = ""
        config.data.text.update(files=f"{text}/train/*.txt", eval_files=f"{text}/validation/*.txt")
        config.data.tokens.update(tokenizer="LlamaTokenizer", vocabulary=f"{text}/spm1024.model")
        config.model.vocabulary_size = 1024
    if arg == "lora":
        config.model.update(preset="{workdir}/base_preset", lora_rank=4)
        config.train.update(steps=40, learning_rate=1e-2, eval_every=20)
    elif arg not in (None, "", "tiny", "spm", "spm_tiny"):
        raise ValueError(f"unknown variant {arg!r} of llama_stdlib; use '', 'tiny', 'lora', "
                         "'spm' or 'spm_tiny'")
    return config
