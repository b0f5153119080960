"""The offline TFDS builders, and a way to prepare them that several hosts can share.

Importing this module registers `stdlib_bytes` and `digits` with TFDS.
"""
import contextlib
import fcntl
import os

import tensorflow_datasets as tfds

from tpu_keras import workdir
from tpu_keras.data.digits import Digits
from tpu_keras.data.stdlib_bytes import StdlibBytes
from tpu_keras.errors import UserError, closest

OFFLINE_BUILDERS = {"stdlib_bytes": StdlibBytes, "digits": Digits}
LOCK_FILENAME = ".prepare.lock"


def written_once(data_dir: str, target: str, write) -> str:
    """`target`, a folder of offline data under `data_dir`, made by `write(partial)` unless it
    is there: `write` fills the folder `partial`, which then becomes `target` at once, so a
    reader never sees half of it. Processes of one machine take turns (`exclusive`)."""
    if os.path.exists(target):
        return target
    with exclusive(os.path.expanduser(data_dir)):
        if not os.path.exists(target):
            partial = target + ".partial"
            write(partial)
            os.rename(partial, target)
    return target


@contextlib.contextmanager
def exclusive(data_dir: str):
    """Holds an flock on data_dir.

    TFDS writes into a temporary folder and renames it at the end, but the
    second of two concurrent renames fails because the target then exists, so
    preparers must take turns. flock only coordinates processes of one machine;
    a remote data_dir (gs://...) is left unlocked and must be prepared by one host.
    """
    if workdir.is_remote(data_dir):
        yield
        return
    try:
        os.makedirs(data_dir, exist_ok=True)
        lock_file = open(os.path.join(data_dir, LOCK_FILENAME), "a")
    except OSError as error:
        raise UserError(f"cannot write to data.data_dir={data_dir!r} ({error.strerror or error}); "
                        "set data.data_dir to a directory you can write to") from None
    with lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def prepare(name: str, data_dir: str) -> tfds.core.DatasetBuilder:
    """Returns the builder for a TFDS name such as "stdlib_bytes/ctx128" or "digits".

    Our offline builders are generated on first use; any other name is returned
    unprepared, exactly as `tfds.builder` gives it.
    """
    dataset_name, kwargs = tfds.core.naming.parse_builder_name_kwargs(name)
    _check_variant(dataset_name.name, kwargs.get("config"))
    if dataset_name.namespace or dataset_name.name not in OFFLINE_BUILDERS:
        return tfds.builder(name, data_dir=data_dir)
    with exclusive(os.fspath(data_dir)):
        # Built inside the lock, so it reads what another process just wrote.
        builder = tfds.builder(name, data_dir=data_dir)
        # Returns at once when the data is already there. try_download_gcs=False:
        # always generate, never fetch a same-named dataset from gs://tfds-data.
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return builder


def _check_variant(name: str, variant) -> None:
    """A one-line error for `name/variant` when the builder has no such variant (config)."""
    try:
        configs = [c.name for c in tfds.builder_cls(name).BUILDER_CONFIGS]
    except tfds.core.registered.DatasetNotFoundError:
        return  # unknown names are reported by the caller, with the known ones
    if variant and configs and variant not in configs:
        raise UserError(f"dataset {name!r} has no variant {variant!r}{closest(variant, configs)}; "
                        f"use one of {[f'{name}/{c}' for c in configs]}")
