"""A process start: TensorFlow and Keras load without the optional packages they probe for."""

import sys

from conftest import run_command

from tpu_keras import lean_imports

LEAN_START = """
import sys
from tpu_keras import lean_imports
from tpu_keras.cluster import engine
lean_imports.install()
engine.select("tf")  # as a tf run does, before Keras loads
import tensorflow, keras, keras_hub  # keras-hub's kagglehub probes for IPython (Colab)
probed = sorted(p for p in ("matplotlib", "IPython", "sklearn", "scipy", "jax") if p in sys.modules)
import sklearn.datasets, scipy.sparse, matplotlib, IPython  # still there for anyone else
print("PROBED", probed, "LATER", sklearn.datasets.load_digits().data.shape)
"""


def test_tensorflow_and_keras_skip_their_optional_probes_and_the_packages_still_import():
    output = run_command([sys.executable, "-c", LEAN_START]).stdout
    assert "PROBED [] LATER (1797, 64)" in output, output[-2000:]


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
