"""Faster process start: TensorFlow and Keras skip their optional-package probes.

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
own lazy imports at call time. The command-line tools install it first
thing. It is never installed by `import tpu_keras`, so a notebook that
imports the toolkit keeps Keras's plotting and notebook display.
`TPU_KERAS_FULL_IMPORTS=1` turns it off.
"""

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


def install() -> None:
    """Makes TensorFlow's and Keras's optional-package probes fail from now on in this process."""
    if os.environ.get(OFF_ENV, "") not in ("", "0"):
        return
    if not any(isinstance(finder, _SkipOptionalProbes) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SkipOptionalProbes())
