"""Text sources: documents, tokenized and packed into sequences of one length.

Documents come from `data.text.files` (a glob of `.txt` files, a document
each, or `.jsonl` files, a document per line under `data.text.field`) or
from a TFDS dataset's text feature (`data.tfds.name` + `data.text.field`). Each
is a `Source` of files like any other, so the sharding plan, the epochs,
resume and the padded evaluation (`pipeline`) work on them unchanged.

From `data.instructions.files`, each .jsonl line is a prompt and a response
instead (`documents.Instructions`), whose prompt tokens weigh 0.

`PackedSource` wraps one: it tokenizes blocks of documents inside tf.data
(`documents`: a document's tokens, then the end token), and packs them into
rows of `data.tokens.context_length + 1` tokens (inputs and shifted targets), a
`mask` beside the tokens carrying their weights where not all are 1:

- as one stream (plain text): joined and cut into rows, so no training
  position is padding; evaluation keeps the last partial row, padded, with
  weight 0;
- apart (instruction data; text with `data.text.document_masks`): each file's
  examples placed whole into rows by best fit within a window (`packing`),
  the model keeping each to itself (`models.segments`), the rest of a row
  padding with weight 0.

To plan exactly-once epochs it must know how many rows a host's files give,
so the tokens (and, packed apart, the rows) of every file are counted: once
per corpus, shared by every host (`token_counts`).
"""

import dataclasses
import functools
import glob as globlib
import math
import os

from absl import logging
import ml_collections
import numpy as np
import tensorflow as tf

from tpu_keras import data_section
from tpu_keras.data import arithmetic, documents as documents_lib, packing as packing_lib, \
    sources, stdlib_instructions, stdlib_preferences, stdlib_text, token_counts, tokenizers
from tpu_keras.errors import UserError

AUTOTUNE = tf.data.AUTOTUNE
DOCUMENTS_PER_BLOCK = 32  # documents tokenized together
DATA_DIR = "{data_dir}"   # in the parts' files and data.tokens.vocabulary: data.data_dir
_OPENED = {}              # (the data section, training) -> its PackedSource
# The offline corpora, each written under data.data_dir the first time a path names it.
_OFFLINE = (stdlib_text, stdlib_instructions, stdlib_preferences, arithmetic)


def resolve(config, workdir: str = "") -> dict:
    """What the data section takes from the model and the run, as {key: value} for the
    `data.tokens` keys it fills (none for data that are not text): `context_length`
    (0: `model.context_length`), for `tokenizer='preset'` the preset's path as `vocabulary`,
    and `counts` (empty: `workdir`/token_counts)."""
    if not data_section.tokenized(config.data):
        return {}
    tokens, filled = config.data.tokens, {}
    if workdir and not tokens.counts:
        filled["counts"] = os.path.join(workdir, "token_counts")
    if not tokens.context_length:
        filled["context_length"] = int(config.model.get("context_length", 0) or 0)
    if tokens.tokenizer == tokenizers.PRESET:
        filled["vocabulary"] = config.model.get("preset", "")
    return filled


def example_end_token(config) -> int:
    """The token that ends each example of text packed apart (the data tokenizer's end
    token), for the model to keep each example to itself (`models.segments`)."""
    return tokenizers.make(prepared(config).tokens).eos_id


def with_data_dir(config):
    """A copy of the data section with '{data_dir}' in its paths (the parts' files, the
    vocabulary) replaced by `data.data_dir`, expanded."""
    data_dir = os.path.expanduser(config.data_dir)
    config = ml_collections.ConfigDict(config.to_dict())
    for part in data_section.TOKENIZED:
        for key in ("files", "eval_files"):
            config[part][key] = config[part][key].replace(DATA_DIR, data_dir)
    config.tokens.vocabulary = config.tokens.vocabulary.replace(DATA_DIR, data_dir)
    return config


def prepared(config):
    """`with_data_dir(config)`, with the offline corpora its paths name (the parts' files,
    the vocabulary) written first: every reader of the data's files or vocabulary goes
    through it, so a shipped config runs on an empty home whichever reads first."""
    data_dir = os.path.expanduser(config.data_dir)
    config = with_data_dir(config)
    paths = [config.tokens.vocabulary] + [config[part][key] for part in data_section.TOKENIZED
                                          for key in ("files", "eval_files")]
    for offline in _OFFLINE:
        if any(path.startswith(offline.folder(data_dir) + os.sep) for path in paths):
            offline.prepare(data_dir)
    return config


def check_vocabulary(tokenizer, model_vocabulary: int, config) -> None:
    """A one-line error, before training, when the tokenizer's ids do not fit the model's
    embedding. An embedding with more rows than the tokenizer has ids is a checkpoint's
    padding (Qwen 2 pads 151,665 ids to 151,936 rows), not a mismatch."""
    if tokenizer.vocabulary_size > model_vocabulary:
        raise UserError(
            f"data.tokens.tokenizer={config.tokens.tokenizer!r} ({tokenizer.name}) has "
            f"{tokenizer.vocabulary_size:,} tokens but the model's embedding has "
            f"{model_vocabulary:,}; set the model's vocabulary size (model.vocabulary_size or "
            f"model.vocab_size) to {tokenizer.vocabulary_size}, or use the model's own tokenizer "
            "(data.tokens.tokenizer='preset')")


@dataclasses.dataclass(frozen=True)
class PackedSource:
    """Sequences of `length` tokens packed from `documents` (a source of documents)."""
    documents: sources.Source
    recipe: object  # documents.Text or documents.Instructions
    tokenizer: tokenizers.Tokenizer
    length: int
    tokens_per_file: tuple[int, ...]
    trained_tokens: int  # the tokens that weigh 1 (all of them, but for instructions)
    trained_bytes: int   # ... and the bytes of their text
    pad_tail: bool  # evaluation: keep the last partial sequence, padded and masked
    packing: packing_lib.Packing | None = None  # examples apart (None: one stream)
    rows_per_file: tuple[int, ...] = ()          # ... the rows each file fills
    tokens_in_rows: int = 0                      # ... the tokens those rows hold

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
        """Trained tokens per byte of their text: turns bits per token into bits per byte."""
        return self.trained_tokens / max(self.trained_bytes, 1)

    @functools.cached_property
    def _tokens_of(self) -> dict:
        """File -> its tokens: a plan asks for every host's files, so not files.index."""
        return dict(zip(self.files, self.tokens_per_file))

    @functools.cached_property
    def _rows_of(self) -> dict:
        return dict(zip(self.files, self.rows_per_file))

    def examples_in(self, files) -> int:
        if self.packing is not None:
            return sum(self._rows_of[f] for f in files)
        tokens = sum(self._tokens_of[f] for f in files)
        return math.ceil(tokens / self.length) if self.pad_tail else tokens // self.length

    @property
    def padding(self) -> float:
        """The share of padding tokens in the rows packed apart (0 for one stream, whose rows
        are all tokens but an evaluation's last)."""
        if self.packing is None:
            return 0.0
        return 1 - self.tokens_in_rows / max(sum(self.rows_per_file) * self.length, 1)

    def read(self, files, deterministic: bool, order_seed=None, with_ids: bool = False):
        """Packed sequences `{"tokens"}` (`{"tokens", "mask"}` with weights) of `files`.

        `with_ids` pairs each sequence with its tokens' ids, shape [length, 2]:
        (document id, position in the document), -1 for padding; a document's
        id is the source's example id (file index * 2**32 + record).
        """
        if self.packing is not None:  # each file's examples apart, whole
            return self.documents.read(files, deterministic, order_seed, with_ids=with_ids,
                                       per_file=functools.partial(self._pack_apart, with_ids=with_ids))
        documents = self.documents.read(files, deterministic, order_seed, with_ids=with_ids)
        blocks = documents.batch(DOCUMENTS_PER_BLOCK).map(
            self._tokenize, num_parallel_calls=AUTOTUNE, deterministic=deterministic)
        return _pack(blocks, self.length, self.pad_tail, with_ids)

    def _pack_apart(self, documents, with_ids: bool):
        """One file's documents -> its rows (`packing`), a window of them at a time."""
        def pack(block, doc_ids=None):
            tokens, weights, _ = self.recipe.tokenize(self.tokenizer, block)
            columns = {"tokens": tokens.flat_values,
                       "mask": (tf.ones_like(tokens) if weights is None else weights).flat_values}
            if doc_ids is not None:
                rows = tokens.row_lengths()
                columns["ids"] = tf.stack([tf.repeat(doc_ids, rows),
                                           tf.ragged.range(rows).flat_values], axis=-1)
            names = sorted(columns)

            def place(sizes, *values):
                packed = self.packing.pack(sizes, dict(zip(names, values)), _PAD)
                return tuple(packed[name] for name in names)
            outputs = tf.numpy_function(place, [tokens.row_lengths()] + [columns[n] for n in names],
                                        [columns[n].dtype for n in names], stateful=False)
            rows = {name: tf.ensure_shape(out, [None, self.length, *columns[name].shape[1:]])
                    for name, out in zip(names, outputs)}
            ids = rows.pop("ids", None)
            return (rows, ids) if doc_ids is not None else rows
        return documents.batch(packing_lib.WINDOW).map(pack).unbatch()

    def _tokenize(self, block, doc_ids=None):
        """A block of documents -> their columns, flat: tokens, weights (where some are not 1,
        or the tail is padded) and ids (given the documents' ids)."""
        tokens, weights, _ = self.recipe.tokenize(self.tokenizer, block)
        columns = {"tokens": tokens.flat_values}
        if weights is not None or self.pad_tail:
            columns["mask"] = (tf.ones_like(tokens) if weights is None else weights).flat_values
        if doc_ids is not None:
            rows = tokens.row_lengths()
            columns["ids"] = tf.stack([tf.repeat(doc_ids, rows), tf.ragged.range(rows).flat_values],
                                      axis=-1)
        return columns


_PAD = {"tokens": 0, "mask": 0, "ids": -1}


def _pack(chunks, length, pad_tail, with_ids):
    """Cuts a stream of chunks (flat columns) into rows of `length`; carries the remainder over.

    A `scan` whose state is the columns not yet in a row, so the work is per
    chunk, not per token. With `pad_tail` a final empty chunk flushes the
    remainder as one last row, padded (tokens 0, mask 0, ids -1).
    """
    empty = {key: tf.zeros([0, *spec.shape[1:]], spec.dtype)
             for key, spec in chunks.element_spec.items()}
    flagged = chunks.map(lambda columns: (columns, False))
    if pad_tail:
        flagged = flagged.concatenate(tf.data.Dataset.from_tensors((empty, True)))

    def step(carried, element):
        columns, flush = element
        joined = {key: tf.concat([carried[key], columns[key]], 0) for key in carried}
        size = tf.shape(joined["tokens"])[0]
        rows = size // length + tf.cast(flush & (size % length > 0), tf.int32)
        used = tf.minimum(size, rows * length)
        cut = {}
        for key, column in joined.items():
            padding = tf.fill([rows * length - used, *column.shape[1:]],
                              tf.cast(_PAD[key], column.dtype))
            cut[key] = tf.reshape(tf.concat([column[:used], padding], 0),
                                  [rows, length, *column.shape[1:]])
        ids = cut.pop("ids", None)
        out = (cut, ids) if with_ids else cut
        return {key: column[used:] for key, column in joined.items()}, out

    return flagged.scan(empty, step).unbatch()


def open_source(config, training: bool, hosts: tuple[int, int] = (0, 1)) -> PackedSource:
    """The train or eval text source of the `data` section, opened once per process: a
    run opens each several times (its metrics, evaluation, every resume).

    `hosts` is (this process, processes): each counts its share of the files'
    tokens, once per corpus (`token_counts`); with `data.tokens.counts`
    empty, it counts them all.
    """
    return sources.opened_once(_OPENED, _open, config, training, tuple(hosts))


def _open(config, training: bool, hosts) -> PackedSource:
    kind = data_section.kind(config)  # 'text' or 'instructions'
    tokenizing = config.tokens
    if tokenizing.context_length < 1:
        raise UserError("data.tokens.context_length is 0 and the model sets no context_length; "
                        "set data.tokens.context_length to the tokens per sequence the model reads")
    data_dir = os.path.expanduser(config.data_dir)
    config = prepared(config)
    part = config[kind]
    tokenizer = tokenizers.make(config.tokens)
    recipe = document_recipe(config)
    if part.files:
        key = f"data.{kind}.files" if training else f"data.{kind}.eval_files"
        pattern = part.files if training else part.eval_files
        if not pattern:
            raise UserError(f"data.{kind}.eval_files is empty; set it to a glob of evaluation "
                            f"files (data.{kind}.files is for training)")
        documents = files_source(pattern, recipe, key)
    else:  # a TFDS dataset's text feature
        split = config.tfds.train_split if training else config.tfds.eval_split
        documents = sources.tfds_source(config.tfds.name, split, data_dir,
                                        "data.tfds.train_split" if training else "data.tfds.eval_split",
                                        text_field=config.text.field)
    packing = packing_of(config)
    fingerprint = f"{tokenizer.fingerprint} {recipe}" + (f" {packing}" if packing else "")
    records = token_counts.gather(documents.files, fingerprint,
                                  lambda indices: _count(documents, recipe, tokenizer, indices, packing),
                                  os.path.expanduser(tokenizing.counts), *hosts,
                                  wait_seconds=tokenizing.counts_wait_seconds)
    documents = dataclasses.replace(documents, files=tuple(
        dataclasses.replace(f, take=r["documents"]) if f.take == LINES else f
        for f, r in zip(documents.files, records)))
    _check_prompts(documents.files, records, tokenizing.context_length,
                   tokenizer.start_id is not None)
    if packing is not None:
        for file, record in zip(documents.files, records):
            tokens, line = record["longest_example"]
            packing_lib.check_longest(file.path, line + 1, tokens, packing)
    source = PackedSource(documents, recipe, tokenizer, tokenizing.context_length + 1,
                          tuple(r["tokens"] for r in records),
                          sum(r["trained_tokens"] for r in records),
                          sum(r["trained_bytes"] for r in records), pad_tail=not training,
                          packing=packing,
                          rows_per_file=tuple(r["rows"] for r in records) if packing else (),
                          tokens_in_rows=sum(r["tokens_in_rows"] for r in records) if packing else 0)
    apart = (f", packed apart into {source.num_examples:,} rows, {source.padding:.1%} of their "
             "tokens padding" if packing else "")
    logging.info("%s: %d documents, %s tokens, %.4f tokens per byte%s%s", source.name,
                 documents.num_examples, f"{sum(source.tokens_per_file):,}",
                 source.tokens_per_byte, " (of the responses)" if kind == "instructions" else "", apart)
    return source


def packing_of(config):
    """How the data section packs its examples apart (`packing.Packing`), or None: one stream."""
    instructions = data_section.kind(config) == "instructions"
    if not (instructions or config.text.document_masks):
        return None
    return packing_lib.Packing(config.tokens.context_length + 1, split_long=not instructions,
                               truncate=instructions and bool(config.instructions.truncate))


def document_recipe(config):
    """What a document is in `config` (the data section): instructions or plain text."""
    if data_section.kind(config) == "instructions":
        return documents_lib.Instructions(config.instructions.prompt_field,
                                          config.instructions.response_field)
    return documents_lib.Text(config.text.field)


LINES = -1  # a .jsonl file's take until its lines are counted


def files_source(pattern: str, recipe, key: str) -> sources.Source:
    """`.txt` files (one document each) or `.jsonl` files (a document per line)."""
    paths = sorted(globlib.glob(os.path.expanduser(pattern), recursive=True))
    if not paths:
        raise UserError(f"{key}={pattern!r} matches no file; set {key} to a glob of existing "
                        ".txt or .jsonl files")
    lines = [p.endswith(".jsonl") for p in paths]
    if any(lines) and not all(lines):
        raise UserError(f"{key}={pattern!r} mixes .jsonl and other files; give a glob of one kind")
    if not all(lines):
        if isinstance(recipe, documents_lib.Instructions):
            raise UserError(f"data.instructions reads .jsonl files of prompts and responses, but "
                            f"{key}={pattern!r} matches other files; give a glob of .jsonl files")
        return sources.Source(pattern, tuple(sources.FileSlice(p, 0, 1) for p in paths),
                              decode=lambda text: text, reader=_whole_file)
    if isinstance(recipe, documents_lib.Text) and not recipe.field:
        raise UserError(f"{key}={pattern!r} holds .jsonl files; set data.text.field to the key "
                        "of each line's text (or set data.instructions.files instead, for prompts "
                        "and responses)")
    return sources.Source(pattern, tuple(sources.FileSlice(p, 0, LINES) for p in paths),
                          decode=recipe.decode, reader=tf.data.TextLineDataset)


def _whole_file(path):
    return tf.data.Dataset.from_tensors(tf.io.read_file(path))


def _count(documents: sources.Source, recipe, tokenizer, indices, packing=None) -> dict:
    """{index: record} of `documents.files[indices]`: its documents, tokens (the end token
    included), bytes, the tokens and bytes trained on, and its longest prompt ([tokens,
    record]); with `packing`, the rows its examples fill apart, the tokens those rows hold
    and its longest example ([tokens, record]). A file with a bad line gets {"error": its
    one-line message}."""
    records, files = {}, {}
    for index in indices:
        file = documents.files[index]
        try:
            take = documents_lib.check_lines(file.path, recipe) if file.take == LINES else file.take
        except UserError as error:
            records[index] = {token_counts.ERROR: str(error)}
            continue
        files[index] = dataclasses.replace(file, take=take)
    if not files:
        return records
    counted = dataclasses.replace(documents, files=tuple(files.values()))
    keys = ("tokens", "trained_tokens", "bytes", "trained_bytes")
    sums = np.zeros((len(files), len(keys)), np.int64)
    longest = np.zeros((len(files), 2), np.int64)  # per file: prompt tokens, its record
    examples = [dict() for _ in files] if packing is not None else None  # record -> its counts

    def stats(block, ids):
        tokens, weights, prompt = recipe.tokenize(tokenizer, block)
        trained = tokens.row_lengths() if weights is None else tf.reduce_sum(weights, axis=1)
        size, trained_size = recipe.sizes(block)
        return ids, tf.stack([tokens.row_lengths(), tf.cast(trained, tf.int64),
                              tf.cast(size, tf.int64), tf.cast(trained_size, tf.int64)], -1), prompt
    read = counted.read(counted.files, deterministic=False, with_ids=True)
    for ids, counts, prompts in read.batch(256).map(stats, num_parallel_calls=AUTOTUNE) \
            .as_numpy_iterator():
        file_of, record_of = ids // 2 ** 32, ids % 2 ** 32
        np.add.at(sums, file_of, counts)
        for file, record, prompt, count in zip(file_of, record_of, prompts, counts):
            if prompt > longest[file, 0]:
                longest[file] = prompt, record
            if examples is not None:
                examples[int(file)][int(record)] = (*count, prompt)  # file: its row in `files`
    for row, (index, file) in enumerate(files.items()):
        records[index] = {"path": file.path, "documents": file.take,
                          **{key: int(value) for key, value in zip(keys, sums[row])},
                          "longest_prompt": [int(v) for v in longest[row]]}
        if examples is not None:
            records[index].update(_apart(packing, recipe, examples[row]))
    return records


def _apart(packing, recipe, examples: dict) -> dict:
    """What a file's examples give packed apart: its rows, the tokens they hold, the tokens
    and bytes trained in them, and its longest example ([tokens, record])."""
    order = sorted(examples)  # records, as the file holds them
    sizes = np.array([examples[r][0] for r in order], np.int64)
    if not len(sizes):
        return {"rows": 0, "tokens_in_rows": 0, "longest_example": [0, 0]}
    kept = np.minimum(sizes, packing.length) if packing.truncate else sizes
    trained = np.array([examples[r][1] for r in order], np.int64)
    trained_bytes = np.array([examples[r][3] for r in order], np.float64)
    prompts = np.array([examples[r][4] for r in order], np.int64)
    if isinstance(recipe, documents_lib.Text):  # in pieces of a row, each one's first no target
        trained_kept = trained - -(-sizes // packing.length)
    else:  # instructions: the response's tokens that fit the row (its first is never one)
        trained_kept = np.maximum(kept - prompts, 0)
    scale = np.divide(trained_kept, trained, out=np.zeros(len(sizes)), where=trained > 0)
    longest = int(np.argmax(sizes))
    return {"rows": packing.rows_of_file(sizes.tolist()), "tokens_in_rows": int(kept.sum()),
            "trained_tokens": int(trained_kept.sum()),
            "trained_bytes": int(round(float((trained_bytes * scale).sum()))),
            "longest_example": [int(sizes[longest]), int(order[longest])]}


def _check_prompts(files, records, context_length: int, start: bool) -> None:
    """A one-line error for a prompt longer than the context: its response would never
    follow it in one sequence."""
    for file, record in zip(files, records):
        tokens, line = record["longest_prompt"]
        if tokens > context_length:
            raise UserError(
                f"{file.path}:{line + 1} has a prompt of {tokens} tokens"
                f"{' (its start token included)' if start else ''}, longer than "
                f"data.tokens.context_length={context_length}, so its response never follows it in "
                f"one sequence; raise data.tokens.context_length (and the model's context_length) to "
                f"at least {tokens}, or shorten that prompt")
