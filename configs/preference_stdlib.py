"""Preference tuning (DPO), offline: configs/instruct_stdlib.py's Llama on prompt, chosen and rejected.

    python -m tpu_keras.train --config=configs/preference_stdlib.py --workdir=/tmp/dpo
    python -m tpu_keras.train --config=configs/preference_stdlib.py:tiny --workdir=/tmp/dpo_tiny

Needs the 'hub' extra. The pairs come from the Python standard library
(tpu_keras.data.stdlib_preferences writes them under data.data_dir on first
use): a function's def line and the first line of its docstring as the
prompt, its own body as the chosen response, the next function's body as the
rejected one. They are tokenized by keras-hub's LlamaTokenizer with the
1,024-piece SentencePiece vocabulary of llama_stdlib's 'spm' variant.

The model is a LoRA fine-tune of a preset (model.preset): here a freshly
initialised Llama that the run writes to DIR/base_preset, an offline
stand-in for a downloaded checkpoint. DPO's reference is that base with the
adapters off. The log line and evaluation give TRL's reward metrics;
val_reward_accuracy starts at 0.5. '' is llama_stdlib's default model size,
'tiny' its tiny one (for tests).

For your own data, point data.preferences.files and .eval_files at .jsonl
files of {"prompt": ..., "chosen": ..., "rejected": ...} lines (other keys:
data.preferences.prompt_field, .chosen_field, .rejected_field), and
model.preset at a checkpoint.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_stdlib  # noqa: E402  (a sibling config file)


def get_config(arg=None):
    if arg not in (None, "", "tiny"):
        raise ValueError(f"unknown variant {arg!r} of preference_stdlib; use '' or 'tiny'")
    config = llama_stdlib.get_config("spm_tiny" if arg == "tiny" else "spm")
    pairs = "{data_dir}/stdlib_preferences"  # '{data_dir}': data.data_dir
    config.data.text.update(files="", eval_files="")  # llama_stdlib's text: pairs instead
    config.data.preprocess = ""  # pairs are read by DPO's own preprocessor
    config.data.preferences.update(files=f"{pairs}/train/*.jsonl",
                                   eval_files=f"{pairs}/validation/*.jsonl")
    config.model.update(context_length=128, preset="{workdir}/base_preset", lora_rank=8)
    config.train.learning_rate = 1e-2
    config.dpo.beta = 0.1
    if arg == "tiny":
        config.train.eval_steps = 4  # 64 pairs: an accuracy to 1/128
    return config
