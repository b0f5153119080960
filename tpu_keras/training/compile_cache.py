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
never reads it (docs/design.md). TensorFlow reads `TF_XLA_FLAGS` once, when
it makes its devices (TensorFlow 2.21), so `prepare` sets it before the
cluster connects; where TensorFlow had started before (a notebook that ran
TensorFlow ops first), the run says so in one line and goes without it.

On the jax engine the train and test steps are also kept whole, as
executables loaded without tracing (`step_cache`, under `steps/`).

A folder that cannot be written costs the run its cache, not the run:
one warning, and it goes on compiling.
"""

# Imported inside functions: TensorFlow (the engine must be selected first: engine.select); JAX
# (optional: absent on a plain install; the tf engine runs without JAX).
import os

from absl import logging

from tpu_keras import workdir as workdir_lib
from tpu_keras.cluster import engine
from tpu_keras.measurement import peak
from tpu_keras.training import step_cache

OFF = ("", "off")
FOLDER = "compile_cache"
# A local cache's bound (least recently used entries go first); bounding it is also
# what makes JAX lock the folder around each read and write.
LOCAL_MAX_BYTES = 4 << 30
# JAX's time spans of tracing, lowering and compiling (or fetching) a program, and the
# step cache's lookups: what the compile figure measures on jax.
_COMPILE_SPANS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration", step_cache.LOOKUP_SPAN)
_JAX_EVENTS = ("/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits",
               step_cache.LOADED_EVENT)


def folder(setting: str, workdir: str) -> str:
    """Where `train.compile_cache = setting` puts the cache of a run in `workdir` ('' off)."""
    if setting.strip().lower() in OFF:
        return ""
    if setting != "auto":
        return workdir_lib.absolute(setting)
    if workdir_lib.is_remote(workdir):
        return os.path.join(workdir, FOLDER)
    return os.path.join(os.path.dirname(peak.cache_file()), FOLDER)


_TF_CACHE_FLAG = "--tf_xla_persistent_cache_directory"
# The folder `prepare` gave TensorFlow before it started ('' if none, or too late).
_tf_folder_in_time = ""


def prepare(setting: str, workdir: str, engine_name: str) -> None:
    """tf engine: gives TensorFlow the cache folder while it can still read it, before the
    cluster makes its devices."""
    global _tf_folder_in_time
    path = folder(setting, workdir) if engine_name == "tf" else ""
    if not path:
        return
    if engine.tensorflow_started():
        return  # too late for another folder (an earlier run of this process set its own)
    flags = [f for f in os.environ.get("TF_XLA_FLAGS", "").split() if not f.startswith(_TF_CACHE_FLAG)]
    os.environ["TF_XLA_FLAGS"] = " ".join(flags + [f"{_TF_CACHE_FLAG}={path}"])
    _tf_folder_in_time = path


def enable(setting: str, workdir: str, cluster, jit_compile: bool) -> "CompileCounter":
    """Turns the cache on for this process (before its steps compile); returns its `CompileCounter`."""
    engine = cluster.engine
    path = folder(setting, workdir)
    if engine == "tf" and (not jit_compile or cluster.kind == "tpu"):
        path = ""  # no XLA program, or one TensorFlow's cache never sees
    if path and engine == "tf" and path != _tf_folder_in_time:
        logging.warning("compile cache %s: TensorFlow had started before it could be told of it "
                        "(it reads TF_XLA_FLAGS once); its steps compile every run (start the "
                        "run before any TensorFlow op, or in a new process)", path)
        path = ""
    if path and not _writable(path):
        path = ""
    if path and engine == "jax":
        import jax
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_compilation_cache_max_size",
                          -1 if workdir_lib.is_remote(path) else LOCAL_MAX_BYTES)
    if path:
        logging.info("compile cache: %s", path)
    return CompileCounter(path, engine)


def keep_steps(model, counter: "CompileCounter", config) -> None:
    """On the jax engine with the cache on, `model`'s train and test steps are kept whole
    (`step_cache`): a rerun of the same config loads them without tracing."""
    if counter.path and counter.engine == "jax":
        step_cache.cache_steps(model, counter.path, config.to_json_best_effort(sort_keys=True))


def _writable(path: str) -> bool:
    """Whether this process can create and write in `path`; else one warning line."""
    reason = workdir_lib.unwritable(path)
    if reason:
        logging.warning("compile cache %s cannot be written (%s); running without it (set "
                        "train.compile_cache to a folder you can write, or 'off')", path, reason)
    return not reason


class CompileCounter:
    """Around the executions it is told of: how long compiling took, and how many step
    programs compiled and how many came from the cache.

    jax: the time is measured, as the union of JAX's time spans of tracing,
    lowering and compiling (or fetching) each program and of `step_cache`'s
    lookups (None where JAX reports no spans: then the first execution's
    excess stands for it, as on tf). The counts are JAX's own events (a
    compile that asked the cache, a hit) and the steps `step_cache` loaded
    whole (each a program from the cache).
    tf: TensorFlow reports no hits to Python, so a first execution that wrote
    no new entry into a cache that held some counts as served by it.
    """

    def __init__(self, path: str, engine: str):
        self.path, self.engine = path, engine
        self._counts = dict.fromkeys(_JAX_EVENTS, 0)
        self.requests = self.hits = self.loaded = 0
        self.compile_seconds = None
        self._entries, self._spans, self._watching = None, [], False
        if engine == "jax":
            import jax
            if path:
                jax.monitoring.register_event_listener(self._on_event)
            listen = getattr(jax.monitoring, "register_event_time_span_listener", None)
            if listen is not None:
                listen(self._on_span)
                self.compile_seconds = 0.0

    def _on_event(self, event, **kwargs):
        if event in self._counts:
            self._counts[event] += 1

    def _on_span(self, event, start_time, end_time, **kwargs):
        if self._watching and event in _COMPILE_SPANS:
            self._spans.append((start_time, end_time))

    def begin(self):
        self._watching, self._spans = True, []
        if self.engine == "jax":
            self._start = dict(self._counts)
        elif self.path:
            self._entries = set(_listing(self.path))

    def end(self):
        self._watching = False
        if self.compile_seconds is not None:
            self.compile_seconds += _covered(self._spans)
        if self.engine == "jax":
            requests, hits, loaded = (self._counts[e] - self._start[e] for e in _JAX_EVENTS)
            requests, hits, self.loaded = requests + loaded, hits + loaded, self.loaded + loaded
        elif self.path:  # a first call compiles at least one program, or reads it
            written = set(_listing(self.path)) - self._entries
            requests = max(len(written), 1)
            hits = 0 if written or not self._entries else 1
        else:
            return
        self.requests += requests
        self.hits += hits

    def report(self) -> dict:
        """{'dir', 'programs' compiled or loaded, 'from_cache' of them, 'steps_loaded' whole
        (untraced) of those, 'compile_seconds' measured or None}; dir '' when off."""
        return {"dir": self.path, "programs": self.requests, "from_cache": self.hits,
                "steps_loaded": self.loaded, "compile_seconds": self.compile_seconds}


def _covered(spans) -> float:
    """Seconds covered by the union of (start, end) `spans` (a trace nests inner ones)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _listing(path: str) -> list:
    import tensorflow as tf
    try:
        return tf.io.gfile.listdir(path)
    except tf.errors.OpError:
        return []
