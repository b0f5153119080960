"""The README's "use it from your own code" example runs as written."""

import re
import sys

import pytest

from conftest import REPO, run


def readme_user_code():
    readme = (REPO / "README.md").read_text()
    return re.search(r"<!-- user-code -->\n```python\n(.*?)```", readme, re.S).group(1)


@pytest.mark.parametrize("engine_env", [
    {},
    {"KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
], ids=["tf", "jax"])
def test_readme_example_is_short_and_trains_under_two_replicas(engine_env):
    code = readme_user_code()
    assert len(code.strip().splitlines()) <= 20
    result = run([sys.executable, "-c", code], env=engine_env)
    accuracies = [float(a) for a in re.findall(r"val_accuracy: ([\d.]+)", result.stdout)]
    assert accuracies and accuracies[-1] > 0.8, result.stdout[-2000:]
