"""A run's folder on any filesystem TensorFlow can write: local, `gs://` on a pod, `ram://` in tests.

Everything a run writes or reads in its workdir goes through `tf.io.gfile`
(or Orbax, which reads `gs://` itself), never through `open` or `os`: on a
pod, `os.makedirs("gs://bucket/run")` would quietly create
`./gs:/bucket/run` on worker 0's disk.
"""

# Imported inside functions: TensorFlow (the engine must be selected first: engine.select).
import os
import uuid

from tpu_keras.errors import UserError, first_line


def is_remote(path: str) -> bool:
    """Whether `path` names a filesystem by scheme (`gs://`, `ram://`, ...)."""
    return "://" in path


def absolute(path: str) -> str:
    """`path` made absolute if it is local; a remote path is absolute already."""
    return path if is_remote(path) else os.path.abspath(os.path.expanduser(path))


def inside(path: str, folder: str) -> bool:
    """Whether `path` lies inside `folder` (a preset in the run's workdir, say)."""
    return os.path.normpath(path).startswith(os.path.normpath(folder) + os.sep)


def prepare(workdir: str) -> None:
    """Creates the workdir (or finds it) and checks that this process can write there."""
    reason = unwritable(workdir)
    if reason:
        raise UserError(f"cannot write to --workdir={workdir} ({reason}); "
                        "choose a directory you can create and write to")


def unwritable(folder: str) -> str:
    """Creates `folder` (or finds it) and writes a file there: '' if that works, else why not."""
    import tensorflow as tf  # lazily: is_remote and absolute serve before TensorFlow loads
    probe = os.path.join(folder, f".write_check_{uuid.uuid4().hex}")
    try:
        tf.io.gfile.makedirs(folder)
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("")
        tf.io.gfile.remove(probe)
        return ""
    except (tf.errors.OpError, OSError) as error:
        return first_line(getattr(error, "message", None) or getattr(error, "strerror", None)
                          or error, limit=None)


# Object stores: an object appears whole when its upload ends, and a rename is a copy.
_OBJECT_STORES = ("gs://", "s3://")


def write_whole(path: str, data) -> None:
    """Writes `data` (text or bytes) to `path` whole or not at all. Elsewhere than on an
    object store, under a temporary name of this writer's own and then a rename: two
    writers of one path (two runs sharing a folder) each rename a complete file. A local
    path is written without TensorFlow (a process that has not loaded it yet need not)."""
    mode = "wb" if isinstance(data, bytes) else "w"
    temporary = f"{path}.{uuid.uuid4().hex}.tmp"
    if not is_remote(path):
        with open(temporary, mode, encoding=None if "b" in mode else "utf-8") as f:
            f.write(data)
        os.replace(temporary, path)
        return
    import tensorflow as tf
    if path.startswith(_OBJECT_STORES):
        with tf.io.gfile.GFile(path, mode) as f:
            f.write(data)
        return
    with tf.io.gfile.GFile(temporary, mode) as f:
        f.write(data)
    tf.io.gfile.rename(temporary, path, overwrite=True)
