"""Text sources: documents, tokenized and packed into sequences of one length.

Documents come from `data.text_files` (a glob of `.txt` files, a document
each, or `.jsonl` files, a document per line under `data.text_field`) or
from a TFDS dataset's text feature (`data.name` + `data.text_field`). Each
is a `Source` of files like any other, so the sharding plan, the epochs,
resume and the padded evaluation (`pipeline`) work on them unchanged.

`PackedSource` wraps one: it tokenizes blocks of documents inside tf.data,
ends each with the tokenizer's end-of-sequence token, and cuts the stream
into sequences of `data.context_length + 1` tokens (inputs and shifted
targets), so no training position is padding. To plan exactly-once epochs
it must know how many sequences a host's files give, so the tokens of
every file are counted once when the source opens (one tokenizing pass,
kept for the process). Evaluation keeps the last partial sequence, padded,
with a mask that gives its padding weight 0.
"""

import dataclasses
import functools
import glob as globlib
import json
import math
import os

from absl import logging
import numpy as np
import tensorflow as tf

from tpu_keras.data import sources, stdlib_text, tokenizers
from tpu_keras.errors import UserError

AUTOTUNE = tf.data.AUTOTUNE
DOCUMENTS_PER_BLOCK = 32  # documents tokenized together
DATA_DIR = "{data_dir}"   # in data.text_files / data.vocabulary: data.data_dir
_OPENED = {}              # (the data section, training) -> its PackedSource


def is_text(config) -> bool:
    return bool(config.text_files or config.text_field)


def resolve(config) -> None:
    """Fills what the data section takes from the model: `data.context_length`
    (0: `model.context_length`), and for `data.tokenizer='preset'` the preset's path."""
    if not is_text(config.data):
        return
    if not config.data.context_length:
        config.data.context_length = int(config.model.get("context_length", 0) or 0)
    if config.data.tokenizer == tokenizers.PRESET:
        config.data.vocabulary = config.model.get("preset", "")


def check_vocabulary(tokenizer, model_vocabulary: int, config) -> None:
    """A one-line error, before training, when the tokenizer's ids and the model's
    embedding do not match."""
    if tokenizer.vocabulary_size != model_vocabulary:
        raise UserError(
            f"data.tokenizer={config.tokenizer!r} ({tokenizer.name}) has "
            f"{tokenizer.vocabulary_size:,} tokens but the model's embedding has "
            f"{model_vocabulary:,}; set the model's vocabulary size (model.vocabulary_size or "
            f"model.vocab_size) to {tokenizer.vocabulary_size}, or use the model's own tokenizer "
            "(data.tokenizer='preset')")


@dataclasses.dataclass(frozen=True)
class PackedSource:
    """Sequences of `length` tokens packed from `documents` (a source of strings)."""
    documents: sources.Source
    tokenizer: tokenizers.Tokenizer
    length: int
    tokens_per_file: tuple[int, ...]
    text_bytes: int
    pad_tail: bool  # evaluation: keep the last partial sequence, padded and masked

    @property
    def name(self) -> str:
        return f"{self.documents.name} ({self.tokenizer.name}, {self.length} tokens per sequence)"

    @property
    def files(self):
        return self.documents.files

    @property
    def num_examples(self) -> int:
        return self.examples_in(self.files)

    @property
    def tokens_per_byte(self) -> float:
        return sum(self.tokens_per_file) / max(self.text_bytes, 1)

    @functools.cached_property
    def _tokens_of(self) -> dict:
        """File -> its tokens: a plan asks for every host's files, so not files.index."""
        return dict(zip(self.files, self.tokens_per_file))

    def examples_in(self, files) -> int:
        tokens = sum(self._tokens_of[f] for f in files)
        return math.ceil(tokens / self.length) if self.pad_tail else tokens // self.length

    def read(self, files, deterministic: bool, order_seed=None, with_ids: bool = False):
        """Packed sequences `{"tokens"}` (`{"tokens", "mask"}` with `pad_tail`) of `files`.

        `with_ids` pairs each sequence with its tokens' ids, shape [length, 2]:
        (document id, position in the document), -1 for padding; a document's
        id is the source's example id (file index * 2**32 + record).
        """
        documents = self.documents.read(files, deterministic, order_seed, with_ids=with_ids)
        blocks = documents.batch(DOCUMENTS_PER_BLOCK).map(
            self._tokenize, num_parallel_calls=AUTOTUNE, deterministic=deterministic)
        return _pack(blocks, self.length, self.pad_tail, with_ids)

    def _tokenize(self, texts, doc_ids=None):
        """A block of documents -> their tokens, each document ended by EOS, flat (and
        their ids, given the documents' ids)."""
        ragged = self.tokenizer.tokenize(texts)
        eos = tf.fill([tf.shape(texts)[0], 1], self.tokenizer.eos_id)
        ragged = tf.concat([ragged, tf.RaggedTensor.from_tensor(eos)], axis=1)
        if doc_ids is None:
            return (ragged.flat_values,)
        rows = ragged.row_lengths()
        ids = tf.stack([tf.repeat(doc_ids, rows), tf.ragged.range(rows).flat_values], axis=-1)
        return ragged.flat_values, ids


def _pack(chunks, length, pad_tail, with_ids):
    """Cuts a stream of token chunks into rows of `length`; carries the remainder over.

    A `scan` whose state is the tokens not yet in a row, so the work is per
    chunk, not per token. With `pad_tail` a final empty chunk flushes the
    remainder as one last row, padded with 0 (id -1) and masked.
    """
    pad_values = (0, -1)
    empty = tuple(tf.zeros([0, *spec.shape[1:]], spec.dtype) for spec in chunks.element_spec)
    flagged = chunks.map(lambda *columns: (columns, False))
    if pad_tail:
        flagged = flagged.concatenate(tf.data.Dataset.from_tensors((empty, True)))

    def step(carried, element):
        columns, flush = element
        joined = tuple(tf.concat([c, new], 0) for c, new in zip(carried, columns))
        size = tf.shape(joined[0])[0]
        rows = size // length + tf.cast(flush & (size % length > 0), tf.int32)
        used = tf.minimum(size, rows * length)
        cut = []
        for column, pad in zip(joined, pad_values):
            padding = tf.fill([rows * length - used, *column.shape[1:]], tf.cast(pad, column.dtype))
            cut.append(tf.reshape(tf.concat([column[:used], padding], 0),
                                  [rows, length, *column.shape[1:]]))
        example = {"tokens": cut[0]}
        if pad_tail:
            example["mask"] = tf.reshape(tf.sequence_mask(used, rows * length, tf.int32),
                                         [rows, length])
        out = (example, cut[1]) if with_ids else example
        return tuple(column[used:] for column in joined), out

    return flagged.scan(empty, step).unbatch()


def open_source(config, training: bool) -> PackedSource:
    """The train or eval text source of the `data` section, opened and counted once per
    process: a run opens each several times (its metrics, evaluation, every resume), and
    opening reads every .jsonl line and tokenizes every file."""
    key = (config.to_json_best_effort(sort_keys=True), training)
    if key not in _OPENED:
        _OPENED[key] = _open(config, training)
    return _OPENED[key]


def _open(config, training: bool) -> PackedSource:
    sources.check_choice(config)
    if config.context_length < 1:
        raise UserError("data.context_length is 0 and the model sets no context_length; set "
                        "data.context_length to the tokens per sequence the model reads")
    data_dir = os.path.expanduser(config.data_dir)
    config = config.copy_and_resolve_references()
    for key in ("text_files", "eval_text_files", "vocabulary"):
        config[key] = config[key].replace(DATA_DIR, data_dir)
    if any(config[key].startswith(stdlib_text.folder(data_dir) + os.sep)
           for key in ("text_files", "eval_text_files", "vocabulary")):
        stdlib_text.prepare(data_dir)  # the offline corpus, written on first use
    tokenizer = tokenizers.make(config)
    if config.text_files:
        key = "data.text_files" if training else "data.eval_text_files"
        pattern = config.text_files if training else config.eval_text_files
        if not pattern:
            raise UserError("data.eval_text_files is empty; set it to a glob of evaluation text "
                            "files (data.text_files is for training)")
        documents = files_source(pattern, config.text_field, key)
    else:
        split = config.train_split if training else config.eval_split
        documents = sources.tfds_source(config.name, split, data_dir,
                                        "data.train_split" if training else "data.eval_split",
                                        text_field=config.text_field)
    counts, text_bytes = _count(documents, tokenizer)
    source = PackedSource(documents, tokenizer, config.context_length + 1, counts, text_bytes,
                          pad_tail=not training)
    logging.info("%s: %d documents, %s tokens, %.4f tokens per byte", source.name,
                 documents.num_examples, f"{sum(counts):,}", source.tokens_per_byte)
    return source


def files_source(pattern: str, text_field: str, key: str) -> sources.Source:
    """`.txt` files (one document each) or `.jsonl` files (a document per line)."""
    paths = sorted(globlib.glob(os.path.expanduser(pattern), recursive=True))
    if not paths:
        raise UserError(f"{key}={pattern!r} matches no file; set {key} to a glob of existing "
                        ".txt or .jsonl files")
    lines = [p.endswith(".jsonl") for p in paths]
    if any(lines) and not all(lines):
        raise UserError(f"{key}={pattern!r} mixes .jsonl and other files; give a glob of one kind")
    if not all(lines):
        return sources.Source(pattern, tuple(sources.FileSlice(p, 0, 1) for p in paths),
                              decode=lambda text: text, reader=_whole_file)
    if not text_field:
        raise UserError(f"{key}={pattern!r} holds .jsonl files; set data.text_field to the key "
                        "of each line's text")
    files = tuple(sources.FileSlice(p, 0, _check_lines(p, text_field)) for p in paths)

    def decode(line):
        text = tf.numpy_function(lambda raw: json.loads(raw)[text_field].encode("utf-8"),
                                 [line], tf.string, stateful=False)
        return tf.ensure_shape(text, [])
    return sources.Source(pattern, files, decode=decode, reader=tf.data.TextLineDataset)


def _whole_file(path):
    return tf.data.Dataset.from_tensors(tf.io.read_file(path))


def _check_lines(path: str, field: str) -> int:
    """The lines of a .jsonl file; a one-line error for the first that lacks `field`."""
    count = 0
    with tf.io.gfile.GFile(path, "rb") as file:
        for count, line in enumerate(file, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{count} is not a JSON object; write one object per "
                                "line, with no blank lines") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                keys = sorted(record) if isinstance(record, dict) else []
                raise UserError(f"{path}:{count} has no text under data.text_field={field!r}; "
                                f"set data.text_field to the key of the text (this line has "
                                f"{keys})")
    return count


def _count(documents: sources.Source, tokenizer) -> tuple[tuple[int, ...], int]:
    """Tokens (EOS included) of each file of `documents`, and the bytes of their text."""
    tokens = np.zeros(len(documents.files), np.int64)
    text_bytes = 0

    def lengths(texts, ids):
        return ids // 2 ** 32, tokenizer.tokenize(texts).row_lengths() + 1, tf.strings.length(texts)
    read = documents.read(documents.files, deterministic=False, with_ids=True)
    for files, counts, sizes in read.batch(256).map(lengths, num_parallel_calls=AUTOTUNE) \
            .as_numpy_iterator():
        np.add.at(tokens, files, counts)
        text_bytes += int(sizes.sum())
    return tuple(int(t) for t in tokens), text_bytes
