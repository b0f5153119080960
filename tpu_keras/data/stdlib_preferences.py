"""Preference pairs made of the standard library, offline: DPO data for tests and
configs/preference_stdlib.py.

Built on `stdlib_instructions`' pairs: the prompt is a function's `def` line
and the first line of its docstring, the chosen response its own body, and
the rejected response the body of the next function in the same file of
pairs (the last takes the first's). So the policy learns to prefer the body
that belongs to the name and the docstring over a well-formed body that does
not. `prepare(data_dir)` writes, once, with the splits and files of
`stdlib_instructions`:

    data_dir/stdlib_preferences/train/*.jsonl, validation/*.jsonl

with `{"prompt": ..., "chosen": ..., "rejected": ...}` lines; a pair whose two
bodies are the same text is left out.
"""

import json
import os

from tpu_keras.data import offline, stdlib_instructions

NAME = "stdlib_preferences"


def folder(data_dir: str) -> str:
    return os.path.join(os.path.expanduser(data_dir), NAME)


def prepare(data_dir: str) -> str:
    """Writes the pairs under `data_dir` unless they are there (and the instruction pairs and
    vocabulary they come from); returns the folder."""
    source = stdlib_instructions.prepare(data_dir)

    def write(partial):
        for split in stdlib_instructions.FILES:
            os.makedirs(os.path.join(partial, split), exist_ok=True)
            for name in sorted(os.listdir(os.path.join(source, split))):
                with open(os.path.join(source, split, name)) as file:
                    pairs = [json.loads(line) for line in file]
                with open(os.path.join(partial, split, name), "w") as file:
                    file.writelines(json.dumps(pair) + "\n" for pair in _preferences(pairs))
    return offline.written_once(data_dir, folder(data_dir), write)


def _preferences(pairs):
    for pair in pairs:
        body = pair["response"]
        flattened = "".join(line.lstrip(" \t") for line in body.splitlines(keepends=True))
        if flattened != body:
            yield {"prompt": pair["prompt"], "chosen": body, "rejected": flattened}
