"""Data, model and hybrid parallelism on the jax engine, with 8 fake CPU devices.

Every mesh runs in its own process (JAX fixes its devices at start-up) via
`tests/helpers/mesh_probe.py`, which trains the same model from the same initial
weights on the same batches and reports each variable's sharding.
"""

import json
import math
import re
import sys

import pytest

from conftest import assert_one_line_error, run_command, run_in_one_process, train, train_args
from placements import assert_laid_out_as_placed, assert_same_losses

LM_TINY = "configs/lm_stdlib.py:tiny"


# The gpt has 4 heads, so the widest model axis is 4 (2x4), not 8. Meshes are
# (data, model), or (data, fsdp, model) for the fully-sharded ones.
MESHES = [(2, 4), (4, 2)]  # data alone: the pods of test_multislice.py, the README's two replicas
FSDP_MESHES = [(1, 8, 1), (2, 2, 2)]  # fsdp alone; and with data and model axes


def _mesh_key(mesh) -> tuple[int, int, int]:
    return (mesh[0], 1, mesh[1]) if len(mesh) == 2 else tuple(mesh)


@pytest.fixture(scope="module")
def probe(data_dir, tmp_path_factory):
    """`probe(data, model)` or `probe(data, fsdp, model)`: 5 steps of configs/lm_stdlib.py's
    gpt on that mesh (memoized).

    The first call runs every mesh in one process of 8 devices: first one device alone,
    which saves the initial weights the others start from, then the 8-device meshes.
    """
    init, results = tmp_path_factory.mktemp("mesh") / "init.npz", {}

    def run_probe(*meshes):
        out = run_command([sys.executable, "tests/helpers/mesh_probe.py",
                   ",".join("x".join(map(str, _mesh_key(m))) for m in meshes),
                   data_dir, str(init), ""], timeout=500).stdout
        for line in out.splitlines():
            if line.startswith("PROBE "):
                result = json.loads(line[len("PROBE "):])
                results[tuple(result["mesh"][a] for a in ("data", "fsdp", "model"))] = result

    def get(*mesh):
        if not results:
            run_probe((1, 1), *MESHES, *FSDP_MESHES)
        return results[_mesh_key(mesh)]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("data_axis,model_axis", MESHES,
                         ids=["model_2x4", "hybrid_4x2"])
def test_mesh_shards_weights_and_matches_one_device(probe, data_axis, model_axis):
    reference, result = probe(1, 1), probe(data_axis, model_axis)
    assert result["mesh"] == {"slices": 1, "data": data_axis, "fsdp": 1, "expert": 1, "context": 1, "model": model_axis}
    split = assert_laid_out_as_placed(result)
    # 10 per block (QKV kernels and biases, attention-out, MLP up kernel and
    # bias, MLP down) + the token embedding + the head's kernel and bias (the
    # position embedding stays whole, like the residual stream it joins).
    assert split == 2 * 10 + 3, split
    # Optimizer state follows its variable.
    momentum = result["optimizer"]["adam_w/block0_mlp_up_kernel_momentum"]
    assert momentum["shard_shape"] == result["weights"]["block0_mlp_up/kernel"]["shard_shape"]
    assert_same_losses(result, reference)


@pytest.fixture(scope="module")
def layouts():
    """`python -m tpu_keras.layout` of lm_stdlib's gpt on the meshes below, in one process:
    {"DATAxFSDPxMODEL": JSON report, "table": the 4x1x2 report as text}."""
    meshes = [(4, 1, 2), *FSDP_MESHES]
    calls = run_in_one_process("tpu_keras.layout", {
        **{"x".join(map(str, m)): ["--config=configs/lm_stdlib.py", f"--config.mesh.data={m[0]}",
                                   f"--config.mesh.fsdp={m[1]}", f"--config.mesh.model={m[2]}", "--json"]
           for m in meshes},
        "table": ["--config=configs/lm_stdlib.py", "--config.mesh.data=4", "--config.mesh.model=2"]})
    assert all(call.returncode == 0 for call in calls.values()), {n: c.stderr[-2000:] for n, c in calls.items()}
    return {name: call.stdout if name == "table" else json.loads(call.stdout) for name, call in calls.items()}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", FSDP_MESHES, ids=["fsdp_1x8x1", "fsdp_2x2x2"])
def test_fsdp_splits_every_large_weight_and_matches_one_device(probe, layouts, mesh):
    reference, result = probe(1, 1), probe(*mesh)
    assert result["mesh"] == {"slices": 1, "expert": 1, "context": 1, **dict(zip(("data", "fsdp", "model"), mesh))}
    assert_laid_out_as_placed(result)
    for path, weight in result["weights"].items():
        if math.prod(weight["shape"]) >= 65_536:  # layout.replicate_below
            assert "fsdp" in weight["spec"], (path, weight)
            assert math.prod(weight["shard_shape"]) * mesh[1] * (
                mesh[2] if "model" in weight["spec"] else 1) == math.prod(weight["shape"]), path
    # Optimizer state follows its weight over fsdp too.
    momentum = result["optimizer"]["adam_w/block0_mlp_up_kernel_momentum"]
    assert momentum["spec"] == result["weights"]["block0_mlp_up/kernel"]["spec"]
    assert momentum["shard_shape"] == result["weights"]["block0_mlp_up/kernel"]["shard_shape"]
    assert_same_losses(result, reference)

    # Device 0 holds, to the byte, what the layout tool reports.
    report = layouts["x".join(map(str, mesh))]
    assert report["totals"]["parameters"]["bytes_per_device"] == result["param_bytes_device0"]
    assert report["totals"]["optimizer"]["bytes_per_device"] == result["optimizer_bytes_device0"]
    notes = {w["path"]: w["note"] for w in report["weights"]}
    assert notes["block0_mlp_up/kernel"].startswith("fsdp on dimension"), notes


@pytest.mark.slow
def test_layout_tool_bytes_match_sharded_variables(probe, layouts):
    table = layouts["table"]
    assert re.search(r"^block0_mlp_up/kernel\s+128x512\s+P\(None, 'model'\)\s+128\.00 KiB$", table, re.M), table
    assert re.search(r"^parameters .* per device$", table, re.M), table
    report = layouts["4x1x2"]

    sharded = probe(4, 2)
    per_weight = {w["path"]: w["bytes_per_device"] for w in report["weights"]}
    assert per_weight == {path: w["bytes_device0"] for path, w in sharded["weights"].items()}
    assert report["totals"]["parameters"]["bytes_per_device"] == sharded["param_bytes_device0"]
    assert report["totals"]["optimizer"]["bytes_per_device"] == sharded["optimizer_bytes_device0"]
    # Split over the model axis, a device holds about half the parameters.
    totals = report["totals"]["parameters"]
    assert 0.5 < totals["bytes_per_device"] / totals["bytes"] < 0.55


@pytest.mark.slow
def test_plan_bytes_match_sharded_variables(probe):
    # v5litepod-8: 8 chips of one device each, the 8 fake devices of probe(4, 2).
    command = [sys.executable, "-m", "tpu_keras.plan", "--config=configs/lm_stdlib.py",
               "--tpu=v5litepod-8", "--config.engine=jax", "--config.mesh.data=4",
               "--config.mesh.model=2", "--json"]
    plan = json.loads(run_command(command, merge_stderr=False).stdout)
    sharded = probe(4, 2)
    assert plan["devices"] == 8 and plan["slices"] == sharded["mesh"]["slices"] == 1
    assert plan["mesh"] == {axis: sharded["mesh"][axis] for axis in ("data", "fsdp", "expert", "context", "model")}
    assert plan["per_device"]["parameters"] == sharded["param_bytes_device0"]
    assert plan["per_device"]["optimizer"] == sharded["optimizer_bytes_device0"]
    assert plan["per_device"]["gradients"] == sharded["param_bytes_device0"]  # all trainable


@pytest.mark.parametrize("axis", ["model", "fsdp"])
def test_tf_engine_refuses_a_model_axis(tmp_path, axis):
    result = train(LM_TINY, tmp_path, "--config.cluster.virtual_devices=2", f"--config.mesh.{axis}=2",
                   check=False)
    assert_one_line_error(result, f"mesh.{axis}=2 needs the jax engine", "--config.engine=jax")


# Mistakes in a mesh or its rules on the jax engine's 8 fake devices: refused by one
# process of tests/helpers/cli_batch.py (one start of JAX and TensorFlow for the four).
MESH_MISTAKES = {
    "does_not_fit": ["--config.mesh.model=3"],
    "indivisible": ["--config.mesh.model=8"],  # the tiny gpt has 2 heads
    "mistyped_rule": ["--config.mesh.model=2", "--config.layout.rules="
                      "((r'block\\d+_mlp_upp/kernel', (None, 'model')),)"],
    "uncovered": ["--config.mesh.model=2", "--config.layout.replicate_below=1024",
                  "--config.layout.rules=((r'block\\d+_mlp_up/kernel', (None, 'model')),)"],
}


@pytest.fixture(scope="module")
def refused(data_dir, tmp_path_factory):
    return run_in_one_process("tpu_keras.train", {
        name: train_args(LM_TINY, tmp_path_factory.mktemp(name), f"--config.data.data_dir={data_dir}",
                         "--config.engine=jax", "--config.cluster.virtual_devices=8", *overrides)
        for name, overrides in MESH_MISTAKES.items()})


def test_mesh_that_does_not_fit_the_devices(refused):
    assert_one_line_error(refused["does_not_fit"], "does not fit 8 devices")


def test_indivisible_shard_is_refused_before_allocation(refused):
    assert_one_line_error(refused["indivisible"], "block0_attention/query/kernel",
                          "dimension 1 (2) does not divide by mesh axis 'model' (8)")


def test_mistyped_rule_is_refused(refused):
    assert_one_line_error(refused["mistyped_rule"], "layout rule 'block\\d+_mlp_upp/kernel' matches no weight",
                          "did you mean 'block0_mlp_up/kernel'?")


def test_uncovered_large_weight_is_refused(refused):
    assert_one_line_error(refused["uncovered"], "weight 'token_embedding/embeddings' [256, 32] "
                          "(8,192 elements) is covered by no layout rule")


@pytest.mark.slow
def test_remat_keeps_the_losses_and_lowers_xla_temporary_bytes(data_dir):
    """'activations' on the gpt, 'blocks' on keras-hub's Llama: the same losses as without."""
    out = run_command([sys.executable, "tests/helpers/remat_probe.py", data_dir], timeout=400).stdout
    runs = {(r["model"], r["remat"]): r for r in (json.loads(line[len("REMAT "):]) for line in out.splitlines()
                                                  if line.startswith("REMAT "))}
    for model, remat in (("gpt", "activations"), ("llama", "blocks")):
        kept, recomputed = runs[model, "none"], runs[model, remat]
        for step, (a, b) in enumerate(zip(kept["losses"], recomputed["losses"])):
            assert abs(a - b) <= 1e-5, (model, step, runs)
        assert recomputed["temp_bytes"] < kept["temp_bytes"], (model, runs)


@pytest.mark.slow
def test_logits_split_over_the_vocabulary_train_as_the_batch_split_ones(data_dir, tmp_path):
    """layout.split_logits on 4 devices split as fsdp=4: the same losses, to float32's rounding
    of the loss's sums taken in another order."""
    logged = {}
    for split in (False, True):
        out = train("configs/llama_stdlib.py:tiny", tmp_path / str(split), "--config.engine=jax",
                    f"--config.data.data_dir={data_dir}", "--config.cluster.virtual_devices=4",
                    "--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.layout.replicate_below=1024",
                    f"--config.layout.split_logits={split}", "--config.export.formats=()").stdout
        logged[split] = [float(x) for x in re.findall(r"step \d+/20 \|.*? loss ([\d.]+)", out)]
    assert len(logged[False]) == 2 and len(logged[True]) == 2, logged
    for a, b in zip(logged[False], logged[True]):
        assert abs(a - b) <= 2e-3 * abs(a), logged


@pytest.mark.slow
def test_blocks_remat_trains_the_same_on_the_tf_engine(data_dir, tmp_path):
    """'blocks' on tf, where `keras.remat` is tf.recompute_grad: the same logged losses."""
    logged = {}
    for remat in ("none", "blocks"):
        out = train("configs/llama_stdlib.py:tiny", tmp_path / remat, "--config.engine=tf",
                    f"--config.data.data_dir={data_dir}", f"--config.train.remat={remat}",
                    "--config.export.formats=()").stdout
        logged[remat] = re.findall(r"step \d+/20 \|.*? loss ([\d.]+)", out)
    assert len(logged["none"]) == 2 and logged["blocks"] == logged["none"], logged
