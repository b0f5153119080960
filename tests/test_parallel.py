"""Data, model and hybrid parallelism on the jax engine, with 8 fake CPU devices.

Every mesh runs in its own process (JAX fixes its devices at start-up) via
`tests/mesh_probe.py`, which trains the same model from the same initial
weights on the same batches and reports each variable's sharding.
"""

import json
import re
import sys

import pytest

from conftest import assert_one_line_error, run, train

LM_TINY = "configs/lm_stdlib.py:tiny"


# The gpt has 4 heads, so the widest model axis is 4 (2x4), not 8.
MESHES = [(8, 1), (2, 4), (4, 2)]


@pytest.fixture(scope="module")
def probe(data_dir, tmp_path_factory):
    """`probe(data, model)`: 5 steps of configs/lm_stdlib.py's gpt on that mesh (memoized).

    The first call runs on one device and saves the initial weights the
    others start from; the 8-device meshes then run in one process.
    """
    init, results = tmp_path_factory.mktemp("mesh") / "init.npz", {}

    def run_probe(*meshes):
        out = run([sys.executable, "tests/mesh_probe.py", ",".join(f"{d}x{m}" for d, m in meshes),
                   data_dir, str(init), ""], timeout=500).stdout
        for line in out.splitlines():
            if line.startswith("PROBE "):
                result = json.loads(line[len("PROBE "):])
                results[result["mesh"]["data"], result["mesh"]["model"]] = result

    def get(data_axis, model_axis):
        if (data_axis, model_axis) not in results:
            run_probe(*MESHES)
        return results[data_axis, model_axis]
    run_probe((1, 1))
    return get


@pytest.mark.parametrize("data_axis,model_axis", MESHES,
                         ids=["data_8x1", "model_2x4", "hybrid_4x2"])
def test_mesh_shards_weights_and_matches_one_device(probe, data_axis, model_axis):
    reference, result = probe(1, 1), probe(data_axis, model_axis)
    mesh = {"data": data_axis, "model": model_axis}
    assert result["mesh"] == mesh

    # Every weight is laid out as its rule says, and really split on the devices.
    split = 0
    for path, weight in result["weights"].items():
        # An axis of size 1 splits nothing: the same as None.
        axes = [a if a and mesh[a] > 1 else None for a in result["expected"][path]]
        spec = weight["spec"] + [None] * (len(axes) - len(weight["spec"]))
        assert spec == axes, path
        assert weight["shard_shape"] == [n // mesh[a] if a else n for n, a in zip(weight["shape"], axes)], path
        split += weight["shard_shape"] != weight["shape"]
    # 10 per block (QKV kernels and biases, attention-out, MLP up kernel and
    # bias, MLP down) + 2 embeddings + the head's kernel and bias.
    assert split == (0 if model_axis == 1 else 2 * 10 + 4), split
    # Optimizer state follows its variable.
    momentum = result["optimizer"]["adam_w/block0_mlp_up_kernel_momentum"]
    assert momentum["shard_shape"] == result["weights"]["block0_mlp_up/kernel"]["shard_shape"]

    # Same initial weights and batches: the same losses as on one device.
    assert len(result["losses"]) == len(reference["losses"]) == 5
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
        assert abs(got - want) <= 1e-4, (step, result["losses"], reference["losses"])


def test_layout_tool_bytes_match_sharded_variables(probe):
    command = [sys.executable, "-m", "tpu_keras.layout", "--config=configs/lm_stdlib.py",
               "--config.mesh.data=4", "--config.mesh.model=2"]
    table = run(command).stdout
    assert re.search(r"^block0_mlp_up/kernel\s+128x512\s+P\(None, 'model'\)\s+128\.00 KiB$", table, re.M), table
    assert re.search(r"^parameters .* per device$", table, re.M), table
    report = json.loads(run(command + ["--json"], merge_stderr=False).stdout)

    sharded = probe(4, 2)
    per_weight = {w["path"]: w["bytes_per_device"] for w in report["weights"]}
    assert per_weight == {path: w["bytes_device0"] for path, w in sharded["weights"].items()}
    assert report["totals"]["parameters"]["bytes_per_device"] == sharded["param_bytes_device0"]
    assert report["totals"]["optimizer"]["bytes_per_device"] == sharded["optimizer_bytes_device0"]
    # Split over the model axis, a device holds about half the parameters.
    totals = report["totals"]["parameters"]
    assert 0.5 < totals["bytes_per_device"] / totals["bytes"] < 0.55


def test_plan_bytes_match_sharded_variables(probe):
    # v5litepod-8: 8 chips of one device each, the 8 fake devices of probe(4, 2).
    command = [sys.executable, "-m", "tpu_keras.plan", "--config=configs/lm_stdlib.py",
               "--tpu=v5litepod-8", "--config.engine=jax", "--config.mesh.data=4",
               "--config.mesh.model=2", "--json"]
    plan = json.loads(run(command, merge_stderr=False).stdout)
    sharded = probe(4, 2)
    assert plan["devices"] == 8 and plan["mesh"] == sharded["mesh"]
    assert plan["per_device"]["parameters"] == sharded["param_bytes_device0"]
    assert plan["per_device"]["optimizer"] == sharded["optimizer_bytes_device0"]
    assert plan["per_device"]["gradients"] == sharded["param_bytes_device0"]  # all trainable


def test_two_hosts_train_a_hybrid_mesh(data_dir, tmp_path):
    result = run([sys.executable, "-m", "tpu_keras.launch", "--hosts=2", "--devices_per_host=4",
                  "--timeout=500", "--", sys.executable, "-m", "tpu_keras.train", f"--config={LM_TINY}",
                  f"--workdir={tmp_path}", f"--config.data.data_dir={data_dir}",
                  "--config.engine=jax", "--config.mesh.model=2"], timeout=560)
    out = result.stdout
    assert "[host 0] " in out and "jax mesh data=4 x model=2 over 2 process(es)" in out
    losses = {host: re.findall(rf"\[host {host}\].*step 20/20 \| .*? loss (\S+)", out) for host in "01"}
    assert losses["0"] and losses["0"] == losses["1"], losses
    prints = dict(re.findall(r"\[host (\d)\].*weights fingerprint: (\S+)", out))
    assert len(prints) == 2 and prints["0"] == prints["1"], prints


def test_tf_engine_refuses_a_model_axis(tmp_path):
    result = train(LM_TINY, tmp_path, "--config.cluster.virtual_devices=2", "--config.mesh.model=2",
                   check=False)
    assert_one_line_error(result, "mesh.model=2 needs the jax engine", "--config.engine=jax")


def _jax(data_dir, tmp_path, *overrides):
    return train(LM_TINY, tmp_path, f"--config.data.data_dir={data_dir}", "--config.engine=jax",
                 "--config.cluster.virtual_devices=8", *overrides, check=False)


def test_mesh_that_does_not_fit_the_devices(data_dir, tmp_path):
    assert_one_line_error(_jax(data_dir, tmp_path, "--config.mesh.model=3"),
                    "does not fit 8 devices")


def test_indivisible_shard_is_refused_before_allocation(data_dir, tmp_path):
    # The tiny gpt has 2 heads; a model axis of 8 cannot split them.
    assert_one_line_error(_jax(data_dir, tmp_path, "--config.mesh.model=8"),
                    "block0_attention/query/kernel", "dimension 1 (2) does not divide by mesh axis 'model' (8)")


def test_mistyped_rule_is_refused(data_dir, tmp_path):
    rules = "((r'block\\d+_mlp_upp/kernel', (None, 'model')),)"
    assert_one_line_error(_jax(data_dir, tmp_path, "--config.mesh.model=2", f"--config.layout.rules={rules}"),
                    "layout rule 'block\\d+_mlp_upp/kernel' matches no weight",
                    "did you mean 'block0_mlp_up/kernel'?")


def test_uncovered_large_weight_is_refused(data_dir, tmp_path):
    rules = "((r'block\\d+_mlp_up/kernel', (None, 'model')),)"
    assert_one_line_error(_jax(data_dir, tmp_path, "--config.mesh.model=2", f"--config.layout.rules={rules}",
                         "--config.layout.replicate_below=1024"),
                    "weight 'token_embedding/embeddings' [256, 32] (8,192 elements) is covered by no layout rule")
