"""A process start: TensorFlow and Keras load without the optional packages they probe for,
and the large packages without Python's cyclic collector."""

import re
import sys

from conftest import run_command

from tpu_keras import lean_imports

LEAN_START = """
import gc, sys
from tpu_keras import lean_imports
from tpu_keras.cluster import engine
lean_imports.install()
engine.select("tf")  # as a tf run does, before Keras loads
collections = lambda: sum(generation["collections"] for generation in gc.get_stats())
before = collections()
import tensorflow, keras
print("COLLECTOR", collections() - before, gc.isenabled(), gc.get_freeze_count())
gc.disable()  # a collector the user turned off stays off
import keras_hub  # keras-hub's kagglehub probes for IPython (Colab)
print("STAYS OFF", gc.isenabled())
gc.enable()
probed = sorted(p for p in ("matplotlib", "IPython", "sklearn", "scipy", "jax") if p in sys.modules)
import sklearn.datasets, scipy.sparse, matplotlib, IPython  # still there for anyone else
print("PROBED", probed, "LATER", sklearn.datasets.load_digits().data.shape)
"""


def test_tensorflow_and_keras_skip_their_optional_probes_and_load_without_the_collector():
    output = run_command([sys.executable, "-c", LEAN_START]).stdout
    assert "PROBED [] LATER (1797, 64)" in output, output[-2000:]
    # no collection while TensorFlow and Keras loaded (hundreds without), what they made
    # frozen, the collector on again; and off where the user had turned it off
    collected, back_on, frozen = re.search(r"COLLECTOR (\d+) (\w+) (\d+)", output).groups()
    assert (int(collected), back_on) == (0, "True") and int(frozen) > 100_000, output[-2000:]
    assert "STAYS OFF False" in output, output[-2000:]


def test_the_environment_variable_turns_it_off(monkeypatch):
    def installed():
        return [f for f in sys.meta_path if isinstance(f, lean_imports._SkipOptionalProbes)]
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f not in installed()])
    monkeypatch.setenv(lean_imports.OFF_ENV, "1")
    lean_imports.install()
    assert not installed()
    monkeypatch.delenv(lean_imports.OFF_ENV)
    lean_imports.install()
    assert len(installed()) == 1  # and monkeypatch puts sys.meta_path back
