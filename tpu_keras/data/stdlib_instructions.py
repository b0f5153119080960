"""Prompts and responses made of the standard library, offline: instruction data for tests and
the `instruct` configs.

Each function of the standard library that has a docstring is one pair: the
prompt is its `def` line and the first line of its docstring, the response
is the rest of its body, as it is written. So the model learns to write a
function from what it is called and what it should do, and only that is
trained on. `prepare(data_dir)` writes, once (the split and the files of
`stdlib_bytes`):

    data_dir/stdlib_instructions/train/*.jsonl, validation/*.jsonl

with `{"prompt": ..., "response": ...}` lines; prompts of at most
`MAX_PROMPT_BYTES` bytes, so that every tokenizer's prompt fits a context of
128 tokens.
"""

import ast
import json
import os

from tpu_keras.data import offline, stdlib_bytes, stdlib_text

NAME = "stdlib_instructions"
MAX_PROMPT_BYTES = 120
MAX_RESPONSE_BYTES = 2_000
FILES = {"train": 8, "validation": 2}


def folder(data_dir: str) -> str:
    return os.path.join(os.path.expanduser(data_dir), NAME)


def prepare(data_dir: str) -> str:
    """Writes the pairs under `data_dir` unless they are there (and the stdlib_text
    vocabulary beside them, which the `instruct` configs read); returns the folder."""
    stdlib_text.prepare(data_dir)
    return offline.written_once(data_dir, folder(data_dir), _write)


def _write(partial: str) -> None:
    pairs = {split: [] for split in FILES}
    for path, split in stdlib_bytes.stdlib_files():
        pairs[split].extend(_pairs((stdlib_bytes.STDLIB_ROOT / path).read_text("utf-8", "replace")))
    for split, count in FILES.items():
        os.makedirs(os.path.join(partial, split), exist_ok=True)
        for index in range(count):
            with open(os.path.join(partial, split, f"part-{index}.jsonl"), "w") as file:
                file.writelines(json.dumps(pair) + "\n" for pair in pairs[split][index::count])


def _pairs(source: str):
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        docstring = ast.get_docstring(node)
        if not docstring or node.body[0].end_lineno >= node.end_lineno:
            continue
        indent = " " * node.body[1].col_offset
        prompt = (lines[node.lineno - 1].strip() + "\n" +
                  f'{indent}"""{docstring.splitlines()[0].strip()}"""\n')
        response = "".join(lines[node.body[0].end_lineno:node.end_lineno])
        if len(prompt.encode()) <= MAX_PROMPT_BYTES and len(response.encode()) <= MAX_RESPONSE_BYTES:
            yield {"prompt": prompt, "response": response}
