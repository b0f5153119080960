"""The persistent compilation cache: a rerun, a resumed run or an evaluation job loads
its compiled steps instead of compiling them again.

`train.compile_cache` says where: 'auto' (the default) is the user's local
cache folder (`~/.cache/tpu_keras/compile_cache`, or under
`$TPU_KERAS_CACHE_DIR`) for a local workdir, so that every run of a model
on a laptop shares it whatever its workdir; and `WORKDIR/compile_cache`
for a workdir on a remote filesystem (`gs://` on a pod), the one folder
that every host of a pod reaches and that outlives its VMs (a preempted
TPU VM loses its disk). A path puts it there; '' or 'off' turns it off.

jax engine: JAX's own persistent cache, for every program however small
or quick to compile. Only process 0 writes entries (JAX's rule), every
process reads them. JAX writes an entry in place (not through a rename),
so on a local folder the cache is size-bounded, which makes JAX take a
file lock around every read and write: two runs on one machine never see
half an entry. On `gs://` an object appears whole when its upload ends.
tf engine: TensorFlow's XLA cache (`TF_XLA_FLAGS=--tf_xla_persistent_cache_
directory`), which serves `jit_compile` functions on CPU and GPU (written
through a rename); TPUStrategy compiles through the TPU compile op, which
never reads it (docs/design.md).

A folder that cannot be written costs the run its cache, not the run:
one warning, and it goes on compiling.
"""

import os

from absl import logging

from tpu_keras.measurement import peak

OFF = ("", "off")
FOLDER = "compile_cache"
# A local cache's bound (least recently used entries go first); bounding it is also
# what makes JAX lock the folder around each read and write.
LOCAL_MAX_BYTES = 4 << 30
_JAX_EVENTS = ("/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits")


def folder(setting: str, workdir: str) -> str:
    """Where `train.compile_cache = setting` puts the cache of a run in `workdir` ('' off)."""
    if setting.strip().lower() in OFF:
        return ""
    if setting != "auto":
        return setting if "://" in setting else os.path.abspath(os.path.expanduser(setting))
    if "://" in workdir:
        return os.path.join(workdir, FOLDER)
    return os.path.join(os.path.dirname(peak.cache_file()), FOLDER)


def enable(setting: str, workdir: str, cluster, jit_compile: bool) -> "Watch":
    """Turns the cache on for this process (before its steps compile); returns its `Watch`."""
    engine = cluster.engine
    path = folder(setting, workdir)
    if engine == "tf" and (not jit_compile or cluster.kind == "tpu"):
        path = ""  # no XLA program, or one TensorFlow's cache never sees
    if path and not _writable(path):
        path = ""
    if path and engine == "jax":
        import jax
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_compilation_cache_max_size", -1 if "://" in path else LOCAL_MAX_BYTES)
    elif path:
        flags = [f for f in os.environ.get("TF_XLA_FLAGS", "").split()
                 if not f.startswith("--tf_xla_persistent_cache_directory")]
        os.environ["TF_XLA_FLAGS"] = " ".join(flags + [f"--tf_xla_persistent_cache_directory={path}"])
    if path:
        logging.info("compile cache: %s", path)
    return Watch(path, engine)


def _writable(path: str) -> bool:
    """Whether this process can create and write in `path`; else one warning line."""
    from tpu_keras import workdir
    reason = workdir.unwritable(path)
    if reason:
        logging.warning("compile cache %s cannot be written (%s); running without it (set "
                        "train.compile_cache to a folder you can write, or 'off')", path, reason)
    return not reason


class Watch:
    """Counts, around the host calls it is told of, the step programs that compiled and
    those that came from the cache.

    jax: JAX's own monitoring events (a compile that asked the cache, a hit).
    tf: TensorFlow reports no hits to Python, so a first host call that wrote
    no new entry into a cache that held some counts as served by it.
    """

    def __init__(self, path: str, engine: str):
        self.path, self._engine = path, engine
        self._counts = dict.fromkeys(_JAX_EVENTS, 0)
        self.requests = self.hits = 0
        self._entries = None
        if path and engine == "jax":
            import jax
            jax.monitoring.register_event_listener(self._on_event)

    def _on_event(self, event, **kwargs):
        if event in self._counts:
            self._counts[event] += 1

    def begin(self):
        if self._engine == "jax":
            self._start = dict(self._counts)
        elif self.path:
            self._entries = set(_listing(self.path))

    def end(self):
        if self._engine == "jax":
            requests, hits = (self._counts[e] - self._start[e] for e in _JAX_EVENTS)
        elif self.path:
            written = set(_listing(self.path)) - self._entries
            requests = len(written) + (1 if self._entries and not written else 0)
            hits = requests - len(written)
        else:
            return
        self.requests += requests
        self.hits += hits

    def report(self) -> dict:
        """{'dir', 'programs' compiled or loaded, 'from_cache' of them}; dir '' when off."""
        return {"dir": self.path, "programs": self.requests, "from_cache": self.hits}


def _listing(path: str) -> list:
    import tensorflow as tf
    try:
        return tf.io.gfile.listdir(path)
    except tf.errors.OpError:
        return []
