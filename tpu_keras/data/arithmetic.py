"""Sums to complete, generated offline: GRPO prompts for tests and configs/grpo_stdlib.py.

Each prompt is a sum of two numbers below 50 with its `=`, such as `"17+25="`,
and the line's `answer` field holds the result as text (`"42"`), which a
reward function compares with the completion (configs/arithmetic_rewards.py).
`warm_start` is the response a supervised warm start trains on: the answer
on every other line, `"?"` on the rest, so the warm-started model leaves
about half the sums unanswered, and reinforcement learning has a behaviour
to change that a small model can change (answering, not the arithmetic).
`prepare(data_dir)` writes, once:

    data_dir/arithmetic/train/prompts.jsonl        2,000 prompts
    data_dir/arithmetic/validation/prompts.jsonl   64 prompts, none of them in train

The same seed writes the same files on every machine.
"""

import json
import os
import random

from tpu_keras.data import offline

NAME = "arithmetic"
SIZES = {"train": 2000, "validation": 64}


def folder(data_dir: str) -> str:
    return os.path.join(os.path.expanduser(data_dir), NAME)


def prepare(data_dir: str) -> str:
    """Writes the prompts under `data_dir` unless they are there; returns the folder."""
    return offline.written_once(data_dir, folder(data_dir), _write)


def _write(partial: str) -> None:
    sums = sorted({(a, b) for a in range(50) for b in range(50)})
    random.Random(0).shuffle(sums)
    start = 0
    for split, size in SIZES.items():
        os.makedirs(os.path.join(partial, split), exist_ok=True)
        with open(os.path.join(partial, split, "prompts.jsonl"), "w") as file:
            for line, (a, b) in enumerate(sums[start:start + size]):
                file.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b),
                                       "warm_start": "?" if line % 2 else str(a + b)}) + "\n")
        start += size
