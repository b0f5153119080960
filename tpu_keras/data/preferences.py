"""Preference pairs for DPO (`data.preferences`): a prompt, a chosen and a rejected response.

Each line of the .jsonl files in `data.preferences.files` (and `eval_files`)
is one pair: its `prompt_field`, `chosen_field` and `rejected_field`. A
pair is one example, so it is never split: the pipeline shards the files per host and the batch per replica as for any
source (`data.pipeline`), each pair once per epoch, and a resumed run
rebuilds its position from the step.

Both responses are tokenized as instruction data is (`documents.Instructions`):
the tokenizer's start token, the prompt, the response, the end token, with
weight 0 on the start token and the prompt and 1 on the response and its end.
They are not packed: each becomes one row of `data.tokens.context_length + 1`
tokens, padded with weight 0, or cut at that length (a response cut short is
scored on the tokens that fit). The example is

    x = {"tokens": int32 [2, L + 1], "mask": float32 [2, L + 1]}  (row 0 chosen, 1 rejected)
    y = 0.0 (DPO's loss reads everything from x; `models.preference`)

Every line is read once when the source opens, for its count and its one-line
errors: a missing field, or a chosen response equal to its rejected one.
"""

import dataclasses
import glob as globlib
import json
import os

import tensorflow as tf

from tpu_keras import data_section
from tpu_keras.data import documents, sources, text, tokenizers
from tpu_keras.errors import UserError

PREPROCESSOR = "preference_pairs"
_OPENED = {}  # (the data section, training) -> its Source


@dataclasses.dataclass(frozen=True)
class Pairs:
    prompt_field: str
    chosen_field: str
    rejected_field: str

    @property
    def fields(self) -> dict:
        return {"data.preferences.prompt_field": ("prompt", self.prompt_field),
                "data.preferences.chosen_field": ("chosen response", self.chosen_field),
                "data.preferences.rejected_field": ("rejected response", self.rejected_field)}

    def problem(self, record: dict) -> str:
        """What is wrong with a pair whose fields are there ('' when nothing is)."""
        if record[self.chosen_field] == record[self.rejected_field]:
            return (f"has the same text under data.preferences.chosen_field={self.chosen_field!r} "
                    f"and data.preferences.rejected_field={self.rejected_field!r}; DPO learns from their "
                    "difference: fix the pair or drop the line")
        return ""

    def decode(self, line):
        keys = (self.prompt_field, self.chosen_field, self.rejected_field)

        def strings(raw):
            record = json.loads(raw)
            return tuple(record[key].encode("utf-8") for key in keys)
        texts = tf.numpy_function(strings, [line], (tf.string,) * 3, stateful=False)
        return {name: tf.ensure_shape(t, []) for name, t in zip(("prompt", "chosen", "rejected"),
                                                                texts)}

    prompt_start = documents.Instructions.prompt_start  # the start token, as instructions have it


def recipe(config) -> Pairs:
    pairs = config.preferences
    return Pairs(pairs.prompt_field, pairs.chosen_field, pairs.rejected_field)


def prompt_recipe(config):
    """How a prompt starts in a run of `config` (the data section), as its training saw one:
    a pair's prompt, or a document's (`text.document_recipe`)."""
    return recipe(config) if data_section.kind(config) == "preferences" else text.document_recipe(config)


def make_tokenizer(config) -> tokenizers.Tokenizer:
    """The tokenizer of the `data` section, the offline vocabulary written first if named."""
    return tokenizers.make(text.prepared(config).tokens)


def open_source(config, training: bool) -> sources.Source:
    """The train or eval pairs of the `data` section: one example per line. Opened once per
    process, since opening reads every line (a run opens each again at every resume)."""
    return sources.opened_once(_OPENED, _open, config, training)


def _open(config, training: bool) -> sources.Source:
    data_section.kind(config)  # one kind of data
    config = text.prepared(config)
    key = "data.preferences.files" if training else "data.preferences.eval_files"
    pattern = config.preferences.files if training else config.preferences.eval_files
    if not pattern:
        raise UserError(f"{key} is empty; set it to a glob of .jsonl files of preference pairs")
    paths = sorted(globlib.glob(os.path.expanduser(pattern), recursive=True))
    if not paths:
        raise UserError(f"{key}={pattern!r} matches no file; set {key} to a glob of existing "
                        ".jsonl files of preference pairs")
    if not all(path.endswith(".jsonl") for path in paths):
        raise UserError(f"data.preferences reads .jsonl files of prompts, chosen and rejected "
                        f"responses, but {key}={pattern!r} matches other files; give a glob of "
                        ".jsonl files")
    pairs = recipe(config)
    files = tuple(sources.FileSlice(path, 0, documents.check_lines(path, pairs)) for path in paths)
    return sources.Source(f"{pattern} (preference pairs)", files, decode=pairs.decode,
                          reader=tf.data.TextLineDataset)


def preprocessor(config):
    """Decoded pairs -> ({"tokens", "mask"}, 0.0): one pair or a block of them alike."""
    tokenizer = make_tokenizer(config)
    start = recipe(config).prompt_start(tokenizer)
    length = config.tokens.context_length + 1

    def preprocess(pair):
        single = pair["prompt"].shape.rank == 0
        block = {key: tf.reshape(value, [-1]) for key, value in pair.items()}
        tokens, mask = tokenize(tokenizer, start, block, length)
        x = {"tokens": tokens, "mask": mask}
        y = tf.zeros(tf.shape(tokens)[:1], tf.float32)
        if single:
            return tf.nest.map_structure(lambda t: t[0], (x, y))
        return x, y
    return preprocess


def tokenize(tokenizer, start: list, block, length: int):
    """(tokens int32 [n, 2, length], mask float32 [n, 2, length]) of a block of pairs."""
    prompt = tokenizer.tokenize(block["prompt"])
    for token in reversed(start):
        prompt = tf.concat([documents.column(block["prompt"], token), prompt], axis=1)
    rows, masks = [], []
    for key in ("chosen", "rejected"):
        response = tf.concat([tokenizer.tokenize(block[key]),
                              documents.column(block[key], tokenizer.eos_id)], axis=1)
        sequence = tf.concat([prompt, response], axis=1)
        weights = tf.concat([tf.zeros_like(prompt), tf.ones_like(response)], axis=1)
        rows.append(sequence.to_tensor(0, shape=[None, length]))
        masks.append(tf.cast(weights.to_tensor(0, shape=[None, length]), tf.float32))
    return tf.stack(rows, axis=1), tf.stack(masks, axis=1)
