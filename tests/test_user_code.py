"""The "use it from your own code" examples run as written, and do what they say: the README's
(`<!-- user-code -->`) and docs/parallelism.md's, a model over a mesh (`<!-- user-code-mesh -->`)."""

import json
import re
import sys

import pytest

from conftest import REPO, run_command


def readme_user_code():
    readme = (REPO / "README.md").read_text()
    return re.search(r"<!-- user-code -->\n```python\n(.*?)```", readme, re.S).group(1)


@pytest.mark.parametrize("engine_env", [
    pytest.param({}, marks=pytest.mark.slow),  # over 15 s: the full suite's (the fast tier keeps within 5 minutes)
    pytest.param({"KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
                 marks=pytest.mark.slow),
], ids=["tf", "jax"])
def test_readme_example_is_short_and_trains_under_two_replicas(engine_env):
    code = readme_user_code()
    assert len(code.strip().splitlines()) <= 20
    result = run_command([sys.executable, "-c", code], env=engine_env)
    accuracies = [float(a) for a in re.findall(r"val_accuracy: ([\d.]+)", result.stdout)]
    assert accuracies and accuracies[-1] > 0.8, result.stdout[-2000:]


PROBE_TAGS = ("SINGLE", "REMOVED", "SECOND", "ACCUM", "PLAN", "MEASURE", "SCALE")  # user_code_probe.py's


def probe_results(output):
    return {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in output.splitlines()
            if line.split(" ", 1)[0] in PROBE_TAGS}


@pytest.mark.slow
def test_the_parallelism_guides_mesh_example_lays_out_checks_accumulates_and_plans_a_users_model():
    # One 4-device process: the guide's example as written, then its promises (user_code_probe.py).
    out = run_command([sys.executable, "tests/helpers/user_code_probe.py"], timeout=600,
                      env={"KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}).stdout
    r = probe_results(out)
    assert set(r) == set(PROBE_TAGS), out[-3000:]
    # fsdp=2 x model=2 trains as one device does.
    single = r["SINGLE"]
    assert single["devices"] == [1] and len(single["mesh"]) == 3, single
    assert all(abs(a - b) <= 1e-5 for a, b in zip(single["mesh"], single["one_device"])), single
    assert single["mesh"][-1] < single["mesh"][0] - 0.5, single  # it learned
    # A rule removed: one line naming the weight, before anything of its shape was allocated.
    removed = r["REMOVED"]
    assert removed["error"] and "\n" not in removed["error"], removed
    assert removed["error"].startswith("weight 'block0_mlp_up/kernel' [64, 256] (16,384 elements) "
                                       "is covered by no layout rule"), removed
    assert [64, 4, 16] in removed["initialized"], removed  # the attention kernels came first
    assert [64, 256] not in removed["initialized"] and removed["restored"], removed
    # Another model with other rules: its own layout; the first keeps its own; no rule left set.
    assert r["SECOND"] == {"first": "P('fsdp', 'model')", "second": "P('model', None)", "restored": True}
    # 4 micro-batches of 16 make the update of one batch of 64, with weights split over fsdp.
    accum = r["ACCUM"]
    assert "fsdp" in accum["fsdp"] and accum["moved"] > 1e-3 and accum["between"] <= 1e-6, accum
    # The user's plan is the CLI's plan of the same model registered as a builder.
    plan = r["PLAN"]
    assert plan["user"] == plan["cli"] and plan["printed"], plan
    assert plan["user"]["mesh"] == {"data": 8, "fsdp": 2, "expert": 1, "context": 1, "model": 2}
    assert plan["user"]["sent_per_step"]["model_all_reduce"] > 0
    # measure=True compiles the sharded step here and gives the compiler's figures beside the plan.
    measure = r["MEASURE"]
    for compiled, backend in ((measure["measured"], "tpu"), (measure["cpu"], "cpu")):
        assert compiled["backend"] == backend and compiled["devices"] == 4, measure
        assert compiled["total"] > 0 and compiled["sent_per_step"]["total"] > 0, measure
    assert measure["measured"]["topology"] == "v5e:2x2" and measure["restored"], measure
    # float16: an overflow halves the loss scale and skips the update, as plain Keras does.
    scale = r["SCALE"]
    assert scale["toolkit"] == scale["keras"], scale
    scales = [2.0**24] + scale["keras"]["scales"]
    assert scales[-1] < 2.0**24 and 0 < scale["keras"]["updates"] < 20, scale  # some overflowed
    assert sum(b < a for a, b in zip(scales, scales[1:])) == 20 - scale["keras"]["updates"], scale
    # The same updates and no others (float16 gradients summed over 2 devices: 3e-5 apart seen).
    assert scale["apart"] <= 1e-3, scale


TF_MODEL_AXIS = """
import tpu_keras
try:
    tpu_keras.connect({"virtual_devices": 4}, mesh=dict(fsdp=2, model=2))
except tpu_keras.UserError as error:
    print("REFUSED", error)
import keras
from tpu_keras.parallelism import Rule
cluster = tpu_keras.connect({"virtual_devices": 4})  # data parallel: mirrored over 4 CPU devices
with cluster.layout([Rule(r"sequential/hidden/kernel", (None, "model"))]) as layout:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="hidden")])
print("PLACED", [p.spec for p in layout.check(model)], type(model.weights[0].value).__name__)
"""


def test_on_the_tf_engine_a_model_axis_is_the_runs_refusal_and_layout_is_the_strategy_scope():
    out = run_command([sys.executable, "-c", TF_MODEL_AXIS], env={"KERAS_BACKEND": "tensorflow"}).stdout
    refused = [line for line in out.splitlines() if line.startswith("REFUSED ")]
    assert refused and refused[0].startswith(
        "REFUSED mesh.model=2 needs the jax engine (--config.engine=jax)"), out[-2000:]
    # Data parallel, the scope is the strategy's: weights mirrored, the rules checked against them.
    assert "PLACED [\"P(None, 'model')\", 'P(None)'] MirroredVariable" in out, out[-2000:]
