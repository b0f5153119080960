"""GRPO's prompts (`data.prompts`): .jsonl lines, each a prompt and the fields its rewards read.

Every host reads every line (a prompt file is small beside the completions
sampled from it) and tokenizes the prompts once, the tokenizer's start token
first where it has one, as instruction data starts a prompt. Which prompts a
batch of samples holds is then a pure function of its index, so a resumed
run samples the same prompts:

- an epoch is one pass over the prompts in an order shuffled by the run's
  seed and the epoch's number; it holds `len(prompts) // per_batch` batches,
  and the few prompts its last batch cannot hold are left out of that epoch
  (others in the next): no prompt twice in an epoch;
- host h of H takes rows h/H to (h+1)/H of each batch, whole prompts, so
  every prompt's group of completions is sampled and scored on one host.

Evaluation reads `eval_files` in file order, every prompt once.
"""

import dataclasses

import numpy as np
import tensorflow as tf  # tf.io.gfile: the files may be on gs://

from tpu_keras import data_section
from tpu_keras.data import json_lines, text, tokenizers
from tpu_keras.errors import UserError


@dataclasses.dataclass
class Prompts:
    records: list       # each line's fields, the prompt's among them
    tokens: list        # each prompt's token ids, the start token first
    where: list         # "FILE line N" of each, for errors
    field: str          # the prompt's field

    def __len__(self):
        return len(self.records)

    def batch(self, index: int, per_batch: int, seed: int, host: int = 0, hosts: int = 1) -> list:
        """The positions of batch `index`'s prompts on `host`: `per_batch` prompts in all."""
        batches = len(self) // per_batch
        epoch, offset = divmod(index, batches)
        order = np.random.default_rng([seed, epoch]).permutation(len(self))
        chosen = order[offset * per_batch:(offset + 1) * per_batch]
        share = per_batch // hosts
        return [int(i) for i in chosen[host * share:(host + 1) * share]]

    def fields(self, positions) -> dict:
        """The other fields of these prompts' lines, each a list in their order: what the
        reward functions receive beside the prompts and completions."""
        names = [name for name in self.records[positions[0]] if name != self.field]
        return {name: [self.records[i].get(name) for i in positions] for name in names}


def read(config, training: bool) -> Prompts:
    """The training (or evaluation) prompts of the `data` section, tokenized; one-line errors
    for missing files, lines that are not JSON objects and prompts that are not text."""
    data_section.kind(config)
    config = text.prepared(config)
    key = "files" if training else "eval_files"
    pattern, field = config.prompts[key], config.prompts.prompt_field
    paths = sorted(tf.io.gfile.glob(pattern)) if pattern else []
    if not paths:
        raise UserError(f"data.prompts.{key}={pattern!r} matches no file; give a glob of .jsonl "
                        f"files of {{\"{field}\": ...}} lines")
    records, where = [], []
    for path in paths:
        for number, record in json_lines.records(path):
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise UserError(f"line {number} of {path} is not a JSON object with a "
                                f"{field!r} string (data.prompts.prompt_field); write one "
                                "such object per line")
            records.append(record)
            where.append(f"{path} line {number}")
    tokenizer = tokenizers.make(config.tokens)
    start = [] if tokenizer.start_id is None else [tokenizer.start_id]
    ids = tokenizer.tokenize(tf.constant([r[field] for r in records]))
    tokens = [start + [int(i) for i in row] for row in ids.to_list()]
    return Prompts(records, tokens, where, field)


def check_lengths(prompts: Prompts, room: int, completion: int) -> None:
    """A one-line error for the first prompt longer than the context leaves it (`room`
    tokens: the context less the completion's `completion` tokens)."""
    for tokens, where in zip(prompts.tokens, prompts.where):
        if len(tokens) > room:
            raise UserError(f"the prompt of {where} is {len(tokens)} tokens, longer than the "
                            f"{room} the context leaves beside grpo.max_completion_length="
                            f"{completion}; shorten it, or raise data.tokens.context_length "
                            "(the model's context) or lower grpo.max_completion_length")


def check_batch(prompts: Prompts, per_batch: int, hosts: int, key: str) -> None:
    """One line where the prompts cannot fill a batch, or a batch cannot be split by hosts."""
    if len(prompts) < per_batch:
        raise UserError(f"data.prompts.{key} holds {len(prompts)} prompts, fewer than the "
                        f"{per_batch} of one batch (train.batch_size / grpo.num_generations); "
                        "give more prompts or lower train.batch_size")
    if per_batch % hosts:
        raise UserError(f"a batch holds {per_batch} prompts (train.batch_size / "
                        f"grpo.num_generations), which {hosts} hosts cannot share evenly; make "
                        f"it a multiple of {hosts}")
