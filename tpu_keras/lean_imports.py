"""Faster process start: TensorFlow and Keras skip their optional-package probes, and the
large packages load without Python's cyclic garbage collector.

At import, TensorFlow and Keras try to import packages that only some of
their features use: matplotlib (Keras's image gallery), IPython (notebook
display; kagglehub, keras-hub's download client, too, to tell whether it runs in
Colab), scikit-learn (Keras's sklearn wrappers), SciPy (TensorFlow's legacy
Keras) and JAX (`tf.lite`, and Keras's Orbax callback when `KERAS_BACKEND`
names another backend). Each probe sits in a `try: import ... except
ImportError` at module level. Together they are about half of
`import tensorflow, keras`: 8.4 s -> 4.7 s on the tf engine and 7.6 s ->
5.5 s on the jax engine, measured on a 2-core CPU. Every host pays this at
every start and restart.

`install()` makes only those module-level probes fail. The same packages
import normally from anywhere else: from the toolkit (scikit-learn for the
digits data), from JAX (which needs SciPy), from user code, and from Keras's
own lazy imports at call time.

Loading TensorFlow, Keras, keras-hub and JAX makes about half a million Python
objects that live as long as the process, and Python's cyclic collector,
run every 700 new objects, walks them over and over: about a fifth of the
import's CPU time in a native profile. `install()` also loads those
packages with the collector off and then moves what they made to the
collector's permanent generation (`gc.freeze`), which later collections
skip; the collector is then back on as it was (off stays off).

The command-line tools install it first
thing. It is never installed by `import tpu_keras`, so a notebook that
imports the toolkit keeps Keras's plotting and notebook display.
`TPU_KERAS_FULL_IMPORTS=1` turns it off.
"""

import gc
import importlib.abc
import os
import sys

# The optional packages that TensorFlow's and Keras's module-level probes should not find.
_OPTIONAL = ("matplotlib", "IPython", "sklearn", "scipy", "jax", "jaxlib")
_IMPORT_MACHINERY = ("importlib", "_frozen_importlib", "_frozen_importlib_external")
OFF_ENV = "TPU_KERAS_FULL_IMPORTS"


def _probers(package: str) -> tuple:
    """The top-level packages whose loading modules may not import `package`. Keras
    imports JAX as its backend unless it is known to run on another one."""
    if package in ("jax", "jaxlib") and os.environ.get("KERAS_BACKEND", "jax") == "jax":
        return ("tensorflow",)  # tf.lite's probe; Keras may need JAX (set by engine.select)
    if package == "IPython":  # kagglehub (keras-hub's download client) looks for Colab
        return ("tensorflow", "keras", "kagglehub")
    return ("tensorflow", "keras")


def _importer(frame):
    """The frame of the code that asked for an import: the first outside the import system."""
    while frame and frame.f_globals.get("__name__", "").partition(".")[0] in _IMPORT_MACHINERY:
        frame = frame.f_back
    return frame


class _SkipOptionalProbes(importlib.abc.MetaPathFinder):
    """Refuses an optional package to a TensorFlow or Keras module that is still loading."""

    def find_spec(self, name, path=None, target=None):
        package = name.partition(".")[0]
        if package not in _OPTIONAL:
            return None
        frame = _importer(sys._getframe(1))  # pylint: disable=protected-access
        importer = frame.f_globals.get("__name__", "") if frame else ""
        if frame and frame.f_code.co_name == "<module>" and importer.partition(".")[0] in _probers(package):
            raise ModuleNotFoundError(f"{name} is skipped while {importer} loads "
                                      f"(tpu_keras.lean_imports; {OFF_ENV}=1 keeps it)", name=name)
        return None


# The packages loaded without the cyclic collector: the toolkit's large dependencies.
_LARGE = ("tensorflow", "keras", "keras_hub", "jax")
_loading = {"depth": 0, "collector_was_on": False}  # the large packages loading now, nested


class _LoadedWithoutCollector:
    """A large package's own loader, run with the cyclic collector off; what the package
    made is frozen once the outermost large package has loaded. Anything else a loader
    answers (resources, source) is the package's own loader's answer."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        if _loading["depth"] == 0:
            _loading["collector_was_on"] = gc.isenabled()
            gc.disable()
        _loading["depth"] += 1
        try:
            self._loader.exec_module(module)
        finally:
            _loading["depth"] -= 1
            if _loading["depth"] == 0 and _loading["collector_was_on"]:
                gc.freeze()  # long-lived: later collections skip them
                gc.enable()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _LargePackagesWithoutCollector(importlib.abc.MetaPathFinder):
    """Finds a large package as the finders after it do, and hands its loader over to
    `_LoadedWithoutCollector`."""

    def find_spec(self, name, path=None, target=None):
        if name not in _LARGE or name in sys.modules:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, (_SkipOptionalProbes, _LargePackagesWithoutCollector)) \
                    or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoadedWithoutCollector(spec.loader)
                return spec
        return None


def install() -> None:
    """From now on in this process, TensorFlow's and Keras's optional-package probes fail,
    and the large packages load without the cyclic collector."""
    if os.environ.get(OFF_ENV, "") not in ("", "0"):
        return
    if not any(isinstance(finder, _SkipOptionalProbes) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SkipOptionalProbes())
    if not any(isinstance(finder, _LargePackagesWithoutCollector) for finder in sys.meta_path):
        sys.meta_path.insert(1, _LargePackagesWithoutCollector())
