"""Token counts of a text corpus, made once and shared by every host and every restart.

Exactly-once epochs need every host to know how many sequences every host's
files give (`file_shards`: an epoch is as many steps as the smallest host
fills), so each file's tokens must be counted, and counting is a full
tokenizing pass. Done by every host at every start, that is hours before
the first step on a pod and a large corpus. Instead each file is counted
once, by one process (file i by process i mod P, so none counts more than
its share), and its count written as a small JSON record into one folder
(`data.tokens.counts`; a run's default is DIR/token_counts). Every process
then reads every record; a restart, or a later run pointed at the same
folder, finds them all and counts nothing.

A record's name is a hash of what its numbers depend on: the file's path,
size and modification time (its slice, for TFDS), the tokenizer's
fingerprint, what is counted (the fields read) and the versions of the
libraries that tokenize (TensorFlow, keras-hub, TF Text, SentencePiece), so
a changed file, tokenizer, field or library is counted anew, never read
stale. Only a file's owner
writes its record, to a temporary name of its own and then a rename, so no
reader sees half of one (two runs sharing the folder may both write one
record: the same numbers). A file with a bad line gets its error as its
record, so every host stops on the same one-line error instead of waiting.
A host that waits `wait_seconds` without any new record arriving (the
counting host died, or the folder is not one every host sees) stops with a
one-line error naming the host and the file it waited for.
"""

import functools
import hashlib
import importlib.metadata
import json
import os
import time
from concurrent import futures

from absl import logging
import tensorflow as tf

from tpu_keras import workdir
from tpu_keras.errors import UserError

ERROR = "error"            # a record of a file that cannot be read: its one-line message
POLL_SECONDS = 0.5         # between looks for the other hosts' records
LOG_EVERY_SECONDS = 60.0
_THREADS = 32              # stats and reads in flight: on gs:// each is a round trip


_TOKENIZING_LIBRARIES = ("tensorflow", "keras-hub", "tensorflow-text", "sentencepiece")


def gather(files, recipe: str, count, folder: str, process: int = 0, processes: int = 1,
           wait_seconds: float = 3600.0) -> list:
    """The record of each of `files` (FileSlices), in order.

    `count(indices)` counts those files here and returns {index: record};
    `recipe` names the tokenizer and fields. Without a `folder` this process
    counts every file itself and shares nothing.
    """
    if not folder:
        return _raise_first_error(count(range(len(files))), files)
    names = _names(files, recipe)
    tf.io.gfile.makedirs(folder)
    present = set(tf.io.gfile.listdir(folder))
    own = [i for i in range(process, len(files), processes) if names[i] not in present]
    if own:
        for index, record in count(own).items():
            workdir.write_whole(os.path.join(folder, names[index]), json.dumps(record))
    records = _wait_for(names, folder, processes, files, wait_seconds)
    logging.info("token counts: %d of %d file(s) counted here, the rest read from %s",
                 len(own), len(files), folder)
    return _raise_first_error(records, files)


def _names(files, recipe: str) -> list:
    def name(file):
        stat = tf.io.gfile.stat(file.path)
        identity = [file.path, file.skip, file.take, stat.length, stat.mtime_nsec, recipe,
                    _library_versions()]
        return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32] + ".json"
    with futures.ThreadPoolExecutor(_THREADS) as pool:
        return list(pool.map(name, files))


@functools.lru_cache(maxsize=None)
def _library_versions() -> tuple:
    """The installed versions of the libraries that tokenize ('' for one not installed)."""
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return ""
    return tuple(version(name) for name in _TOKENIZING_LIBRARIES)


def _wait_for(names, folder, processes, files, wait_seconds) -> dict:
    """Every record, read as soon as it is there (the other hosts are counting theirs); a
    one-line error once `wait_seconds` pass with no new record."""
    records, started, logged = {}, time.monotonic(), time.monotonic()
    progressed = started
    with futures.ThreadPoolExecutor(_THREADS) as pool:
        while True:
            present = set(tf.io.gfile.listdir(folder))
            ready = [i for i, name in enumerate(names) if i not in records and name in present]
            for index, record in zip(ready, pool.map(
                    lambda i: _read(os.path.join(folder, names[i])), ready)):
                records[index] = record
                progressed = time.monotonic()
            missing = [i for i in range(len(names)) if i not in records]
            if not missing:
                return records
            if time.monotonic() - progressed > wait_seconds:
                first = missing[0]
                raise UserError(
                    f"token counts: waited {wait_seconds:g} s for the count of "
                    f"{files[first].path} (and {len(missing) - 1} more file(s)), which host "
                    f"{first % processes} writes into {folder}, and none came; that host "
                    "stopped (check its log) or does not see this folder: set data.tokens.counts "
                    "to a folder every host sees, such as gs://..., and restart (counts made "
                    "are kept), or raise data.tokens.counts_wait_seconds for a very large file")
            if time.monotonic() - logged > LOG_EVERY_SECONDS:
                logged = time.monotonic()
                hosts = sorted({i % processes for i in missing})
                logging.info("token counts: waiting %.0f s for %d file(s) that host(s) %s count "
                             "into %s (data.tokens.counts must be a folder every host sees, "
                             "such as gs://...)", logged - started, len(missing), hosts, folder)
            time.sleep(POLL_SECONDS)


def _read(path: str) -> dict:
    with tf.io.gfile.GFile(path) as file:
        return json.loads(file.read())


def _raise_first_error(records: dict, files) -> list:
    for index in range(len(files)):
        if ERROR in records[index]:
            raise UserError(records[index][ERROR])
    return [records[index] for index in range(len(files))]
