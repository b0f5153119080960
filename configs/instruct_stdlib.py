"""Instruction tuning, offline: configs/llama_stdlib.py's Llama on prompt and response pairs.

    python -m tpu_keras.train --config=configs/instruct_stdlib.py --workdir=/tmp/instruct
    python -m tpu_keras.train --config=configs/instruct_stdlib.py:tiny --workdir=/tmp/instruct_tiny

Needs the 'hub' extra. The pairs come from the Python standard library
(tpu_keras.data.stdlib_instructions writes them under data.data_dir on
first use): a function's def line and the first line of its docstring as the
prompt, its body as the response. They are tokenized by keras-hub's
LlamaTokenizer with the 1,024-piece SentencePiece vocabulary of
llama_stdlib's 'spm' variant (start token, prompt, response, end token),
packed apart (each pair whole in a row, attending to itself alone; a pair
longer than the row cut to it: data.instructions.truncate), and the loss, bits per token
and bits per byte count the responses alone. '' is llama_stdlib's default model, 'tiny' its tiny one (for tests).

To tune on your own data, point data.instructions.files and .eval_files at
.jsonl files of {"prompt": ..., "response": ...} lines (other keys:
data.instructions.prompt_field, .response_field), and model.preset at a checkpoint.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_stdlib  # noqa: E402  (a sibling config file)


def get_config(arg=None):
    if arg not in (None, "", "tiny"):
        raise ValueError(f"unknown variant {arg!r} of instruct_stdlib; use '' or 'tiny'")
    config = llama_stdlib.get_config("spm_tiny" if arg == "tiny" else "spm")
    pairs = "{data_dir}/stdlib_instructions"  # '{data_dir}': data.data_dir
    config.data.text.update(files="", eval_files="")  # llama_stdlib's text: instructions instead
    config.data.instructions.update(files=f"{pairs}/train/*.jsonl",
                                    eval_files=f"{pairs}/validation/*.jsonl")
    # stdlib_instructions keeps prompts of at most 120 bytes: they fit 128 tokens. A function's
    # body is often longer than the row: cut to it (truncate), as TRL's max_length cuts.
    config.model.context_length = max(config.model.context_length, 128)
    config.data.instructions.truncate = True
    return config
