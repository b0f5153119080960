"""Compiled steps kept whole between processes (jax engine): a rerun, a resumed run or an
evaluation job loads its train and test steps without tracing them.

JAX's persistent cache (`compile_cache`) saves XLA's compile, but its key
is the lowered program, so each process must first trace and lower every
step to look it up. For a large model on a pod the trace is seconds and
the compile minutes; for a small model the trace is most of what a cached
rerun still pays (1.5 s of 2 s for the default gpt on a CPU).

This cache keys a step's serialized executable on everything that decides
its program *before* it is traced:

- the run's resolved config (the model, optimizer, precision, ...), and the
  model's own Keras config and compile config (its architecture as built,
  a preset's values included, and its loss, metrics and optimizer with
  their constants, a tokens-per-byte scale among them),
- the step's abstract arguments: the pytree of state and batch, each
  array's shape, dtype and sharding over which devices,
- the devices and this process's place among them, and the versions and
  flags of Python, JAX, XLA and Keras,
- and, as Python itself decides that a `.pyc` is stale, the size and
  modification time of the file of every module that was loaded when the
  step was traced, and of every file whose code ran in the trace, the
  user's own code included: an entry serves only while each of them is
  unchanged.

Code that lives in no file (a notebook cell, `python -c`, `exec` of a
string) cannot be checked that way, so a step whose trace ran any gets no
entry: it is compiled (through JAX's cache, which keys on the lowered
program) every time, with one line saying why. So does a model whose
Keras config cannot be written.

Anything else is a miss: the step is traced and compiled as before
(through JAX's cache, so often still no XLA compile) and its entry written
again. Each process writes entries of its own (its index is in the key),
so two hosts never write one file; a local entry appears through a rename,
a `gs://` object whole when its upload ends. An entry that cannot be read
is a miss with one warning line. Entries are pickles, so the cache folder
must be as trusted as the code (JAX's own cache has the same rule).
"""

# Imported inside functions: Keras and TensorFlow (the engine must be selected first:
# engine.select); JAX (optional: absent on a plain install; the tf engine runs without
# JAX); NumPy (start-up time: not every caller needs it).
import hashlib
import json
import os
import pickle
import platform
import sys
import time
import zlib
from importlib import metadata

from absl import logging

from tpu_keras import workdir
from tpu_keras.errors import first_line

FOLDER = "steps"
# JAX monitoring events (compile_cache.CompileCounter counts them): a step loaded whole from this
# cache, and the time span of each first call's lookup, load or compile.
LOADED_EVENT = "/tpu_keras/step_cache/loaded"
LOOKUP_SPAN = "/tpu_keras/step_cache/lookup"
# A local folder keeps the newest entries up to this size (a step of a large model is large).
LOCAL_MAX_BYTES = 2 << 30
_KERAS_STEPS = ("train", "test")
# The environment variables that change what XLA builds (JAX's own flags are in its config).
_COMPILER_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
# JAX settings that say what to log, dump or keep, not what to build: left out of the key
# (one left in costs a miss, never a wrong program).
_JAX_CONFIG_NOT_IN_PROGRAMS = ("log", "cache", "dump", "pprint", "traceback", "timeout",
                               "transfer_guard")


def cache_steps(model, cache_dir: str, config_json: str):
    """Makes `model`'s jitted train and test steps `CachedStep`s kept in `cache_dir/steps/`."""
    from keras.src.backend.jax import trainer as keras_jax_trainer
    folder = _join(cache_dir, FOLDER)
    for name in _KERAS_STEPS:
        make = getattr(model, f"make_{name}_function")

        def make_cached(force=False, make=make, name=name):
            # Keras jits its step through this module attribute; for this one call, the
            # jitted step it builds is wrapped (its host loop and shardings stay Keras's own).
            jit = keras_jax_trainer.jit
            keras_jax_trainer.jit = lambda fn, **kwargs: CachedStep(
                jit(fn, **kwargs), name, folder, config_json, lambda: describe_model(model),
                lambda: model_code(model) | code_of(fn))
            try:
                return make(force)
            finally:
                keras_jax_trainer.jit = jit
        setattr(model, f"make_{name}_function", make_cached)
    return model


class CachedStep:
    """A jitted step that, on its first call, loads its executable from the cache or
    compiles and stores it; later calls run that executable."""

    def __init__(self, jitted, name: str, folder: str, config_json: str, describe=lambda: "",
                 model_code=lambda: set()):
        _JaxCacheHits.listen()
        self._jitted, self.name, self._folder, self._config = jitted, name, folder, config_json
        self._describe = describe  # the model's description for the key; None: no entry
        self._model_code = model_code  # {(file, module)} of the model's own code
        self._compiled = None
        self._plain = False  # called with other arguments than it was compiled for: plain jit

    def __call__(self, *args):
        if self._plain:
            return self._jitted(*args)
        if self._compiled is None:
            self._compiled = self._load_or_compile(args)
        try:
            return self._compiled(*args)
        except (TypeError, ValueError) as error:
            # Arguments of another shape or layout (checked before anything runs):
            # from now on jax.jit, which keys on them.
            logging.info("%s step: %s; tracing it for these arguments",
                         self.name, first_line(error))
            self._plain = True
            return self._jitted(*args)

    def _load_or_compile(self, args):
        import jax
        start = time.time()
        try:
            return self._load_or_compile_untimed(args)
        finally:
            record = getattr(jax.monitoring, "record_event_time_span", None)  # newer JAX only
            if record is not None:
                record(LOOKUP_SPAN, start, time.time())

    def _load_or_compile_untimed(self, args):
        import jax
        from jax.experimental import serialize_executable
        model = self._describe()
        if model is None:
            logging.info("%s step: not kept whole (the model's Keras config cannot be written, "
                         "so a changed model would not be told apart)", self.name)
            return self._jitted.lower(*args).compile()
        key = entry_key(self.name, self._config, args, model)
        path = _join(self._folder, f"{self.name}-{key}")
        entry = _read(path)
        if entry is not None and (stale := stale_sources(entry["sources"])):
            logging.info("%s step: the kept one is stale (%s); compiling it", self.name, stale)
            entry = None
        if entry is not None:
            try:
                compiled = serialize_executable.deserialize_and_load(
                    entry["executable"], entry["in_tree"], entry["out_tree"],
                    execution_devices=_devices_by_id(entry.get("devices")))
                jax.monitoring.record_event(LOADED_EVENT)
                logging.info("%s step: loaded from %s, not traced", self.name, path)
                return compiled
            except Exception as error:  # noqa: BLE001 -- any unreadable entry is a miss
                logging.warning("%s step: cached executable %s did not load (%s); compiling "
                                "it again", self.name, path, first_line(error))
        served_before = _JaxCacheHits.count
        if _interactive():  # cells and `python -c` live in no file: see what the trace runs
            lowered, traced_files = _tracing_code(lambda: self._jitted.lower(*args))
        else:  # a script: the model's own code is enough to look at (a trace runs 2.5x slower)
            lowered, traced_files = self._jitted.lower(*args), self._model_code()
        compiled = lowered.compile()
        if (fileless := code_without_a_file(traced_files)):
            logging.info("%s step: not kept whole (its trace ran code that lives in no file, "
                         "%s, so a change to it could not be told apart); compiled through "
                         "JAX's cache, which keys on the program", self.name, fileless)
            return compiled
        if _JaxCacheHits.count > served_before:
            # XLA:CPU serializes an executable it loaded from JAX's cache without its
            # kernels (the loaded copy fails: "Function ... not found"). Kept when it compiles.
            logging.info("%s step: not kept whole (JAX's cache served it)", self.name)
            return compiled
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError) as error:
            logging.info("%s step: not kept whole (%s)", self.name, first_line(error))
            return compiled
        sources = {**loaded_sources(), **_stats(path for path, _ in traced_files)}
        _write(path, {"sources": sources, "executable": executable,
                      "in_tree": in_tree, "out_tree": out_tree,
                      "devices": _execution_device_ids(compiled)})
        return compiled


def _execution_device_ids(compiled):
    """The ids of the devices the step runs on, in the order its program numbers them: its
    mesh's, which on a TPU (and a pod simulated in a TPU's order) is not JAX's device order.
    None when no argument is laid out on a mesh (one device)."""
    import jax
    for sharding in jax.tree.leaves(compiled.input_shardings):
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and hasattr(mesh, "devices"):
            return [device.id for device in mesh.devices.flat]
    return None


def _devices_by_id(ids):
    """The devices `_execution_device_ids` recorded, for `deserialize_and_load`: by default it
    hands a program JAX's device order, and a program compiled for another order aborts the
    process at its first call (JAX 0.10: "PjRtBuffer's memory space is addressed by device
    ... vs sharding is on device ...")."""
    if ids is None:
        return None
    import jax
    by_id = {device.id: device for device in jax.devices()}
    return [by_id[i] for i in ids]


class _JaxCacheHits:
    """Hits in JAX's own persistent cache in this process, once a step has been made."""
    count, _listening = 0, False

    @classmethod
    def listen(cls):
        if not cls._listening:
            import jax
            jax.monitoring.register_event_listener(cls._on_event)
            cls._listening = True

    @classmethod
    def _on_event(cls, event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            cls.count += 1


# Entries before 2 lack the devices' order, and load wrong on a mesh in another order;
# before 3, the model's config and the files of the traced code.
_ENTRY_FORMAT = 3


def describe_model(model) -> str | None:
    """The model's Keras config and compile config as JSON, or None where Keras cannot
    write them (a subclassed model without `get_config`)."""
    try:
        return json.dumps([model.get_config(), model.get_compile_config()], sort_keys=True,
                          default=repr)
    except (NotImplementedError, TypeError, ValueError, AttributeError):
        return None


def _interactive() -> bool:
    """Whether this process may hold code in no file: `python -c`, stdin, or an IPython or
    Jupyter shell. IPython merely imported is no shell: kagglehub (keras-hub's download
    client) imports it at start-up in every script, and a script's trace would be watched,
    2.5x slower, for nothing."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return not (isinstance(main_file, str) and os.path.isfile(main_file)) or _in_a_shell()


def _in_a_shell() -> bool:
    """Whether an IPython shell (a notebook's kernel among them) runs in this process."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return shell is not None and shell() is not None


def model_code(model) -> set:
    """{(file, module)} of the code of `model`, its layers, loss, metrics and optimizer: the
    Python the step runs beyond Keras's own."""
    objects = [model, *model._flatten_layers(include_self=False), getattr(model, "optimizer", None)]
    loss = getattr(model, "loss", None)
    objects += [loss, getattr(loss, "fn", None)]
    for metric in getattr(model, "metrics", []):
        objects += [metric, getattr(metric, "_fn", None)]
    files = set()
    for item in objects:
        if item is not None:
            files |= code_of(item)
    return files


def code_of(item) -> set:
    """{(file, module)} of a function's code, or of every method a class (or an instance's
    class) defines."""
    if callable(item) and hasattr(item, "__code__"):
        return {(item.__code__.co_filename, item.__module__)}
    cls = item if isinstance(item, type) else type(item)
    return {(value.__code__.co_filename, cls.__module__) for klass in cls.__mro__
            for value in vars(klass).values() if hasattr(value, "__code__")}


def _tracing_code(trace):
    """(trace(), {(file, module globals' name)} of every Python function called in it)."""
    codes, generated = set(), {}
    add = codes.add

    def profile(frame, event, arg):  # kept small: it runs at every call of the trace
        code = frame.f_code
        if code not in codes:
            add(code)
            if code.co_filename[:1] == "<":
                generated[code] = frame.f_globals.get("__name__")
    if sys.getprofile() is not None:  # a profiler or debugger holds the hook: nothing to tell by
        return trace(), {(WATCHED_BY_ANOTHER, None)}
    sys.setprofile(profile)
    try:
        result = trace()
    finally:
        sys.setprofile(None)
    return result, {(code.co_filename, generated.get(code)) for code in codes}


# What the trace "ran" where another tool (cProfile, a debugger) holds the profile hook: the
# step's code cannot be watched, so it counts as code in no file and the step is not kept.
WATCHED_BY_ANOTHER = "<code the trace ran, unseen: a profiler holds sys.setprofile>"


# The namespace `collections.namedtuple` compiles a tuple's methods in (their class's own
# module holds the definition, and is among the loaded modules).
_GENERATED_BY_THE_STANDARD_LIBRARY = "namedtuple_"


def code_without_a_file(traced_files) -> str:
    """The first code of `traced_files` that lives in no file ('' if none): its source is
    neither a file on disk nor generated inside a module that has one (as dataclasses
    generate their methods)."""
    for path, module_name in sorted(traced_files, key=lambda item: (item[0], str(item[1]))):
        if os.path.isfile(path) or path.startswith("<frozen ") or str(module_name).startswith(
                _GENERATED_BY_THE_STANDARD_LIBRARY):
            continue
        module = sys.modules.get(module_name) if module_name else None
        module_file = getattr(module, "__file__", None) if module is not None else None
        if not (isinstance(module_file, str) and os.path.isfile(module_file)
                and module_name != "__main__"):
            return f"{path} in {module_name or 'no module'}"
    return ""


def _stats(paths) -> dict:
    """{path: [size, mtime_ns]} of those of `paths` that are files."""
    stats = {}
    for path in paths:
        try:
            stat = os.stat(path)
        except OSError:
            continue
        stats[path] = [stat.st_size, stat.st_mtime_ns]
    return stats


def entry_key(name: str, config_json: str, args, model: str = "") -> str:
    """The hex digest of what decides step `name`'s program, short of its source files."""
    import jax
    import keras
    leaves, treedef = jax.tree.flatten(args)
    devices = jax.devices()
    described = {
        "entry": _ENTRY_FORMAT, "step": name, "config": config_json, "model": model,
        "tree": str(treedef),
        "leaves": [_describe_leaf(leaf) for leaf in leaves],
        "devices": [devices[0].platform, devices[0].client.platform_version,
                    sorted({d.device_kind for d in devices}), len(devices),
                    jax.process_index(), jax.process_count()],
        "versions": [sys.version, jax.__version__, _version("jaxlib"), keras.__version__],
        "keras": [keras.config.floatx(), keras.config.dtype_policy().name,
                  keras.config.image_data_format()],
        "jax_config": {k: repr(v) for k, v in sorted(jax.config.values.items())
                       if not any(word in k for word in _JAX_CONFIG_NOT_IN_PROGRAMS)},
        "env": [os.environ.get(name, "") for name in _COMPILER_ENV],
        "cpu": _cpu_flags() if devices[0].platform == "cpu" else "",
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=repr).encode()).hexdigest()[:40]


def _describe_leaf(leaf):
    import numpy as np
    sharding = getattr(leaf, "sharding", None)
    where = None
    if sharding is not None:
        mesh = getattr(sharding, "mesh", None)
        ids = (np.asarray(mesh.device_ids).tolist() if mesh is not None and hasattr(mesh, "device_ids")
               else sorted(d.id for d in sharding.device_set))
        where = [repr(sharding), ids, getattr(leaf, "committed", None)]
    return [list(np.shape(leaf)), str(getattr(leaf, "dtype", type(leaf).__name__)),
            bool(getattr(getattr(leaf, "aval", None), "weak_type", False)), where]


def loaded_sources() -> dict:
    """{path: [size, mtime_ns]} of the file of every module loaded in this process."""
    return _stats({module.__file__ for module in list(sys.modules.values())
                   if isinstance(getattr(module, "__file__", None), str)})


def stale_sources(recorded: dict) -> str | None:
    """Why an entry that recorded `recorded` cannot serve this process (one of those files
    changed or gone), or None when it can."""
    for path, (size, mtime_ns) in recorded.items():
        try:
            stat = os.stat(path)
        except OSError:
            return f"{path} is gone"
        if (stat.st_size, stat.st_mtime_ns) != (size, mtime_ns):
            return f"{path} changed"
    return None


def _read(path: str):
    """The entry at `path`, or None (absent, or unreadable: one warning)."""
    import tensorflow as tf
    try:
        with tf.io.gfile.GFile(path, "rb") as f:
            data = f.read()
    except tf.errors.NotFoundError:
        return None
    except tf.errors.OpError as error:
        logging.warning("step cache: cannot read %s (%s); compiling the step", path, first_line(error))
        return None
    try:
        entry = pickle.loads(zlib.decompress(data))
        if not isinstance(entry, dict) or not {"sources", "executable", "in_tree", "out_tree"} <= entry.keys():
            raise ValueError("not an entry of this cache")
    except Exception as error:  # noqa: BLE001 -- a truncated or foreign file is a miss
        logging.warning("step cache: %s is not a readable entry (%s); compiling the step",
                        path, first_line(error))
        _remove(path)  # one warning, not one per run; a new entry takes its place
        return None
    if not workdir.is_remote(path):  # local: recently used, pruned last
        os.utime(path)
    return entry


def _write(path: str, entry: dict) -> None:
    """Writes `entry` whole or not at all; a failure costs the entry, not the run."""
    import tensorflow as tf
    data = zlib.compress(pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL), 1)
    try:
        tf.io.gfile.makedirs(os.path.dirname(path))
        workdir.write_whole(path, data)
        if not workdir.is_remote(path):
            _prune(os.path.dirname(path), LOCAL_MAX_BYTES)
    except (tf.errors.OpError, OSError) as error:
        logging.warning("step cache: cannot write %s (%s); the step is compiled again next time",
                        path, first_line(error))


def _remove(path: str) -> None:
    import tensorflow as tf
    try:
        tf.io.gfile.remove(path)
    except tf.errors.OpError:
        pass


def _prune(folder: str, max_bytes: int) -> None:
    """Deletes the least recently used entries of a local folder beyond `max_bytes`."""
    entries = []
    for name in os.listdir(folder):
        try:
            stat = os.stat(os.path.join(folder, name))
        except OSError:
            continue
        entries.append((stat.st_mtime, stat.st_size, name))
    total = sum(size for _, size, _ in entries)
    for _, size, name in sorted(entries):
        if total <= max_bytes:
            break
        try:
            os.remove(os.path.join(folder, name))
        except OSError:
            pass
        total -= size


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if workdir.is_remote(folder) else os.path.join(folder, name)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def _cpu_flags() -> str:
    """The host CPU's model and feature flags: XLA:CPU compiles for the CPU it runs on."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return hashlib.sha256("".join(sorted(set(lines))).encode()).hexdigest()
    except OSError:
        return platform.processor()
