"""Byte-level language-modelling corpus made of the Python standard library.

Every machine that runs this package already has the corpus on disk, so
language-model training and its tests work offline and identically on every
host of a pod.
"""
import dataclasses
import functools
import os
import pathlib
import sysconfig
import zlib

import numpy as np
import tensorflow_datasets as tfds

STDLIB_ROOT = pathlib.Path(sysconfig.get_paths()["stdlib"])
# Third-party packages are not the stdlib, and the stdlib's own test suites
# are dominated by generated fixtures that would skew the byte statistics.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
VALIDATION_PERCENT = 5
# `tfds.ReadConfig(input_context=...)` shards by file, so each split needs at
# least one file per input pipeline (host); these counts allow pods of up to
# 32 training hosts and 16 evaluating hosts.
NUM_SHARDS = {"train": 32, "validation": 16}


def _split_of(relative_path: str) -> str:
    """Assigns a file to a split by crc32, which (unlike hash()) never changes."""
    bucket = zlib.crc32(relative_path.encode("utf-8")) % 100
    return "validation" if bucket < VALIDATION_PERCENT else "train"


def stdlib_files() -> list[tuple[str, str]]:
    """Returns sorted (posix path relative to STDLIB_ROOT, split) pairs."""
    found = []
    for dirpath, dirnames, filenames in os.walk(STDLIB_ROOT):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for filename in filenames:
            if filename.endswith(".py"):
                path = pathlib.Path(dirpath, filename).relative_to(STDLIB_ROOT)
                found.append((path.as_posix(), _split_of(path.as_posix())))
    return sorted(found)


def split_stream(split: str) -> bytes:
    """Returns a split's files in path order, joined by newlines, as raw bytes."""
    return b"\n".join(
        (STDLIB_ROOT / path).read_bytes()
        for path, file_split in stdlib_files()
        if file_split == split)


def _shard_examples(rows: np.ndarray, shard_index: int, num_shards: int):
    """Yields every num_shards-th row, so that each shard spans the whole corpus."""
    for row_index in range(shard_index, len(rows), num_shards):
        yield row_index, {"tokens": rows[row_index]}


@dataclasses.dataclass(eq=False, kw_only=True)
class StdlibBytesConfig(tfds.core.BuilderConfig):
    """Names a context length L; examples hold L + 1 bytes (inputs + shifted targets)."""

    context_length: int


class StdlibBytes(tfds.core.ShardBasedBuilder):
    """Python stdlib source as fixed-length byte sequences.

    ShardBasedBuilder (rather than GeneratorBasedBuilder) because it fixes the
    number of files per split inside the builder, whatever DownloadConfig the
    caller passes; GeneratorBasedBuilder would write this 12 MB corpus as one file.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    # The first config is the default.
    BUILDER_CONFIGS = [
        StdlibBytesConfig(
            name=f"ctx{length}", description=f"Examples of {length} + 1 bytes.",
            context_length=length)
        for length in (128, 64, 256, 512)
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=(
                "The .py files of the running Python's standard library (test "
                "suites and third-party packages left out), split into train and "
                "validation by a crc32 of each file's path, concatenated in path "
                "order and cut into non-overlapping byte sequences of "
                "context_length + 1 bytes."),
            features=tfds.features.FeaturesDict({
                "tokens": tfds.features.Tensor(
                    shape=(self.builder_config.context_length + 1,), dtype=np.uint8,
                    # One bytes field per example instead of an int64 per byte.
                    encoding=tfds.features.Encoding.BYTES),
            }),
        )

    def _shard_iterators_per_split(self, dl_manager):
        del dl_manager  # Nothing to download.
        row_length = self.builder_config.context_length + 1
        iterators = {}
        for split, num_shards in NUM_SHARDS.items():
            stream = np.frombuffer(split_stream(split), dtype=np.uint8)
            num_rows = len(stream) // row_length
            rows = stream[: num_rows * row_length].reshape(num_rows, row_length)
            iterators[split] = [
                functools.partial(_shard_examples, rows, shard_index, num_shards)
                for shard_index in range(num_shards)
            ]
        return iterators
