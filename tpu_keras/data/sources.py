"""Where examples come from: file slices plus a decoder.

A TFDS split (sliced or not, e.g. `train[:90%]`) and a glob of TFRecord
files both reduce to the same thing: a list of `(file, skip, take)` slices of
serialized examples and a function that decodes one. The sharding policy then
works on files and counts alone, whatever the source.
"""

import dataclasses
import glob as globlib
import os
import re
from typing import Callable

import tensorflow as tf
import tensorflow_datasets as tfds

from tpu_keras import workdir
from tpu_keras.data import offline
from tpu_keras.errors import UserError, closest

AUTOTUNE = tf.data.AUTOTUNE


@dataclasses.dataclass(frozen=True)
class FileSlice:
    path: str
    skip: int
    take: int


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    files: tuple[FileSlice, ...]
    decode: Callable[[tf.Tensor], dict]
    # Opens one file as a dataset of records: TFRecords here; lines or whole
    # files for the text sources (tpu_keras.data.text).
    reader: Callable[[tf.Tensor], tf.data.Dataset] = tf.data.TFRecordDataset

    @property
    def num_examples(self) -> int:
        return self.examples_in(self.files)

    def examples_in(self, files) -> int:
        """The examples `files` hold: a plan counts each host's share with it."""
        return sum(f.take for f in files)

    def read(self, files, deterministic: bool, order_seed=None,
             with_ids: bool = False, per_file=None) -> tf.data.Dataset:
        """Decoded examples of `files`, read and decoded in parallel.

        `order_seed` (a shape [2] tensor) permutes the files statelessly, so an
        epoch's file order depends on nothing but the seed. `with_ids` pairs
        each example with its id: its file's index in the source times 2**32
        plus its record's index in that file. `per_file` maps each file's
        decoded examples, in the file's order, before the files interleave
        (text packed apart: a file's rows are its own examples').
        """
        files = list(files)
        columns = (tf.constant([f.path for f in files]),
                   tf.constant([f.skip for f in files], tf.int64),
                   tf.constant([f.take for f in files], tf.int64),
                   tf.constant([self.files.index(f) for f in files], tf.int64))
        if order_seed is not None:
            order = tf.random.experimental.stateless_shuffle(tf.range(len(files)), order_seed)
            columns = tuple(tf.gather(column, order) for column in columns)

        decode = (lambda record, id_: (self.decode(record), id_)) if with_ids else self.decode

        def records(path, skip, take, file_index):
            file = self.reader(path).skip(skip).take(take)
            if with_ids:
                ids = tf.data.Dataset.range(skip, skip + take).map(lambda i: file_index * 2 ** 32 + i)
                file = tf.data.Dataset.zip(file, ids)
            if per_file is None:
                return file
            return per_file(file.map(decode, num_parallel_calls=AUTOTUNE, deterministic=True))

        read = tf.data.Dataset.from_tensor_slices(columns).interleave(
            records, cycle_length=min(16, len(files)), num_parallel_calls=AUTOTUNE,
            deterministic=deterministic)
        if per_file is not None:
            return read
        return read.map(decode, num_parallel_calls=AUTOTUNE, deterministic=deterministic)


def opened_once(opened: dict, open_source, config, *args):
    """`open_source(config, *args)`, kept in `opened` for the rest of the process, keyed by
    the whole data section and the arguments: opening a text or pairs source reads every
    line, and a run opens each several times (metrics, evaluation, every resume)."""
    key = (config.to_json_best_effort(sort_keys=True), *args)
    if key not in opened:
        opened[key] = open_source(config, *args)
    return opened[key]


def open_source(config, training: bool) -> Source:
    """The train or eval source: `data.tfds` (a TFDS dataset, with its splits) or
    `data.tfrecords` (TFRecord globs). Text is `text.open_source`'s."""
    if config.tfrecords.files:
        records = config.tfrecords
        pattern = records.files if training else records.eval_files
        if not pattern:
            raise UserError("data.tfrecords.eval_files is empty; set it to a glob of evaluation "
                            "TFRecord files (data.tfrecords.files is for training)")
        return tfrecord_source(pattern, dict(records.features),
                               "data.tfrecords.files" if training else "data.tfrecords.eval_files")
    split = config.tfds.train_split if training else config.tfds.eval_split
    return tfds_source(config.tfds.name, split, os.path.expanduser(config.data_dir),
                       "data.tfds.train_split" if training else "data.tfds.eval_split")


def tfds_source(name: str, split: str, data_dir: str, split_key: str = "split",
                text_field: str = "") -> Source:
    """A TFDS split; with `text_field`, its examples decode to that text feature alone."""
    if not name:
        raise UserError("the data section names no data; set data.tfds.name to a TFDS name such "
                        "as 'stdlib_bytes' or 'digits', or the files of another part (data.tfrecords, "
                        "data.text, data.instructions, data.preferences)")
    try:
        builder = offline.prepare(name, data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        known = sorted(offline.OFFLINE_BUILDERS) + ["any TFDS dataset prepared under data.data_dir"]
        raise UserError(f"unknown dataset {name!r}{closest(name.split('/')[0], tfds.list_builders())}; "
                        f"use one of {known}") from None
    if not builder.info.splits:
        missing = "" if workdir.is_remote(data_dir) or os.path.isdir(data_dir) else " (no such directory)"
        raise UserError(f"dataset {name!r} is not prepared in data.data_dir={data_dir!r}{missing}; "
                        f"set data.data_dir to where it is, or prepare it there with "
                        f"`tfds build {name} --data_dir={data_dir}`")
    try:
        split_info = builder.info.splits[split]
    except (KeyError, ValueError):
        raise UserError(f"{split_key}={split!r}: dataset {name!r} has no such split; use one of "
                        f"{sorted(builder.info.splits)}, or a slice such as 'train[:90%]'") from None
    files = tuple(FileSlice(f.filename, f.skip, f.take) for f in split_info.file_instructions)
    decode = builder.info.features.deserialize_example
    if text_field:
        features = builder.info.features
        if text_field not in features or features[text_field].dtype != tf.string:
            texts = sorted(k for k in features if features[k].dtype == tf.string)
            raise UserError(f"dataset {name!r} has no text feature data.text.field={text_field!r}"
                            f"{closest(text_field, texts)}; set data.text.field to one of {texts}")
        decode = lambda record: builder.info.features.deserialize_example(record)[text_field]
    return Source(f"{name}[{split}]", files, decode)


_SPEC = re.compile(r"^(\w+)(?:\[([\d, ]*)\])?$")


def tfrecord_source(pattern: str, features: dict, key: str = "data.tfrecords.files") -> Source:
    """TFRecord files of tf.train.Examples; `features` maps names to 'int64', 'float32[4]', ..."""
    paths = sorted(globlib.glob(os.path.expanduser(pattern)))
    if not paths:
        raise UserError(f"{key}={pattern!r} matches no file; set {key} to a glob of existing "
                        "TFRecord files")
    if not features:
        raise UserError("data.tfrecords.features is empty; map each feature to a type such as "
                        "'int64' or 'float32[8,8]'")
    spec = {}
    for key, text in features.items():
        match = _SPEC.match(str(text))
        if not match or match.group(1) not in ("int64", "float32", "string"):
            raise UserError(f"data.tfrecords.features.{key}={text!r} is not 'int64', 'float32' or "
                            "'string', optionally with a shape such as 'float32[8,8]'")
        shape = [int(d) for d in match.group(2).split(",")] if match.group(2) else []
        spec[key] = tf.io.FixedLenFeature(shape, tf.dtypes.as_dtype(match.group(1)))
    files = tuple(FileSlice(p, 0, _count_records(p)) for p in paths)
    return Source(pattern, files, lambda record: tf.io.parse_single_example(record, spec))


def _count_records(path: str) -> int:
    """Counts the records of one file; raises a UserError if it is corrupt."""
    try:
        return int(tf.data.TFRecordDataset(path).reduce(tf.constant(0, tf.int64),
                                                        lambda n, _: n + 1))
    except tf.errors.DataLossError:
        raise UserError(f"{path} is not a readable TFRecord file (corrupt or truncated); write "
                        "it again, or leave it out of data.tfrecords.files") from None
