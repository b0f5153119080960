"""The mesh arithmetic and the layout checks, as plain functions (no devices needed)."""

import pytest

from tpu_keras import parallelism
from tpu_keras.parallelism import mesh
from tpu_keras.errors import UserError


@pytest.mark.parametrize("config, devices, expected", [
    ({"data": -1, "model": 1}, 8, {"slices": 1, "data": 8, "fsdp": 1, "model": 1}),
    ({"data": -1, "model": 2}, 8, {"slices": 1, "data": 4, "fsdp": 1, "model": 2}),
    ({"data": 2, "model": -1}, 8, {"slices": 1, "data": 2, "fsdp": 1, "model": 4}),
    ({"data": 4, "model": 2}, 8, {"slices": 1, "data": 4, "fsdp": 1, "model": 2}),
    ({}, 1, {"slices": 1, "data": 1, "fsdp": 1, "model": 1}),
    ({"data": 2, "fsdp": -1, "model": 2}, 16, {"slices": 1, "data": 2, "fsdp": 4, "model": 2}),
    # Each slice's shape: 2 slices of 8 devices, data x fsdp x model inside each.
    ({"slices": 2, "fsdp": 2}, 16, {"slices": 2, "data": 4, "fsdp": 2, "model": 1}),
    ({"slices": 4, "data": 1, "model": -1}, 16, {"slices": 4, "data": 1, "fsdp": 1, "model": 4}),
    # A mixture of experts' experts split over `expert`, which splits the batch elsewhere.
    ({"data": -1, "expert": 2}, 8, {"slices": 1, "data": 4, "fsdp": 1, "expert": 2, "model": 1}),
    ({"data": 1, "fsdp": 2, "expert": 2, "model": -1}, 8, {"slices": 1, "data": 1, "fsdp": 2, "expert": 2, "model": 2}),
])
def test_mesh_resolves_against_the_devices(config, devices, expected):
    assert mesh.resolve(config, devices) == {"expert": 1, "context": 1, **expected}


@pytest.mark.parametrize("config, devices, message", [
    ({"data": -1, "model": 3}, 8, "does not fit 8 devices"),
    ({"data": 4, "model": 4}, 8, "needs 16 devices but there are 8"),
    ({"data": -1, "model": -1}, 8, "-1 on one axis"),
    ({"data": 0, "model": 1}, 8, "positive size"),
    ({"slices": 3}, 8, "mesh.slices=3 does not divide the 8 devices"),
    ({"slices": 2, "model": 3}, 8, "does not fit 4 devices per slice"),
    ({"slices": 2, "data": 2, "model": 4}, 8, "needs 16 devices but there are 8"),
    ({"slices": 0}, 8, "mesh.slices=0 is not valid"),
])
def test_mesh_that_cannot_be_built_says_why(config, devices, message):
    with pytest.raises(UserError, match=message):
        mesh.resolve(config, devices)


def test_tf_engine_accepts_only_a_data_axis():
    assert mesh.resolve({"data": -1}, 4, "tf") == {"slices": 1, "data": 4, "fsdp": 1, "expert": 1,
                                                   "context": 1, "model": 1}
    for axis in ("model", "fsdp", "expert", "context", "slices"):
        with pytest.raises(UserError, match=f"mesh.{axis}=2 needs the jax engine"):
            mesh.resolve({"data": -1, axis: 2}, 4, "tf")
    with pytest.raises(UserError, match="mesh axis 'fdsp' is not one of"):
        mesh.check({"fdsp": 2})


def rows_of(data, model, devices_per_process):
    """`batch_rows` of a (data, 1, model) grid of CPU devices in process order."""
    devices = [FakeDevice(i, i // devices_per_process) for i in range(data * model)]
    return mesh.batch_rows(mesh.device_grid(devices, 1, data, 1, 1, 1, model), model)


@pytest.mark.parametrize("data, model, per_process, process, expected", [
    (4, 2, 4, 0, (2, 0)),   # 2 hosts x 4 devices, model axis inside a host
    (4, 2, 4, 1, (2, 1)),
    (8, 1, 4, 1, (2, 1)),
    (2, 4, 4, 1, (2, 1)),   # one data row per host
    (1, 8, 4, 1, (1, 0)),   # the model axis spans both hosts: one shared pipeline
    (4, 2, 8, 0, (1, 0)),   # one process holds everything
])
def test_input_pipelines_follow_the_data_rows_a_process_holds(data, model, per_process, process,
                                                             expected):
    assert mesh.input_pipelines(rows_of(data, model, per_process), process) == expected


def test_a_host_may_feed_rows_far_apart_as_on_a_tpu():
    # data=16 on a v5litepod-16, as libtpu lays it out: host 0 holds rows 0, 1, 6 and 15.
    rows = {0: (0, 1, 6, 15), 1: (2, 3, 4, 5), 2: (7, 12, 13, 14), 3: (8, 9, 10, 11)}
    assert [mesh.input_pipelines(rows, p) for p in range(4)] == [(4, 0), (4, 1), (4, 2), (4, 3)]
    fed = mesh.feed_rows(rows, 32)  # 2 examples per row: host 0's 8 land at 0-3, 12-13, 30-31
    assert fed[0] == [0, 1, 2, 3, 12, 13, 30, 31]
    assert sorted(p for positions in fed.values() for p in positions) == list(range(32))


def test_hosts_holding_overlapping_but_different_rows_are_refused():
    # 2 hosts x 3 devices with model=2: host 0 holds rows 0 and 1, host 1 rows 1 and 2.
    with pytest.raises(UserError, match=r"hosts 0 and 1 hold different but overlapping batch rows "
                                        r".*use a mesh.model that divides the devices of a host"):
        mesh.input_pipelines(rows_of(3, 2, 3), 0)


class W:  # what place_all reads from a variable
    def __init__(self, path, shape, dtype="float32"):
        self.path, self.shape, self.dtype = path, shape, dtype


MESH = {"data": 2, "model": 4}


def test_a_rule_that_is_the_path_wins_over_patterns_as_in_keras_layout_map():
    rules = [parallelism.Rule("d0/.*", ("model", None)), parallelism.Rule("d0/kernel", (None, "model"))]
    placed = parallelism.place_all([W("d0/kernel", (16, 64)), W("d0/bias", (64, 4))], rules, MESH)
    assert [p.axes for p in placed] == [(None, "model"), ("model", None)]
    # The same lookup as keras.distribution.LayoutMap's, on the same keys.
    import keras
    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh(
        (1, 1), ["data", "model"], [["cpu:0"]]))
    for rule in rules:
        layout_map[rule.pattern] = rule.axes
    assert [layout_map[p].axes for p in ("d0/kernel", "d0/bias")] == [p.axes for p in placed]
    assert parallelism.rules_from_layout_map(layout_map) == rules


def test_rules_place_weights_and_count_bytes_per_device():
    rules = [parallelism.Rule(r"d\d+/kernel", (None, "model")), parallelism.replicated(r"d\d+/bias")]
    placed = parallelism.place_all([W("d0/kernel", (16, 64)), W("d0/bias", (64,)), W("n/gamma", (16,))],
                              rules, MESH)
    assert [p.axes for p in placed] == [(None, "model"), (None,), (None,)]
    assert [p.bytes_per_device(MESH) for p in placed] == [16 * 16 * 4, 64 * 4, 16 * 4]
    assert placed[0].spec == "P(None, 'model')" and placed[0].shard_shape(MESH) == (16, 16)


@pytest.mark.parametrize("rules, weights, message", [
    ([parallelism.Rule("d0/kernel", (None, "modle"))], [W("d0/kernel", (4, 4))], "mesh axis 'modle'.*'model'"),
    ([parallelism.Rule("d0/kernel", ("model",))], [W("d0/kernel", (4, 4))], "gives 1 axes .* of shape \\[4, 4\\]"),
    ([parallelism.Rule("d0/.*", ()), parallelism.Rule(r"d\d/kernel", ())], [W("d0/kernel", (4, 4))], "matches two layout rules"),
    ([parallelism.Rule("d0/kernel", (None, "model"))], [W("d0/kernel", (4, 6))], "dimension 1 \\(6\\) does not divide"),
    ([parallelism.Rule("d1/kernel", ())], [W("d0/kernel", (4, 4))], "'d1/kernel' matches no weight"),
    ([], [W("emb/embeddings", (512, 128))], "covered by no layout rule"),
])
def test_bad_rules_are_refused(rules, weights, message):
    with pytest.raises(UserError, match=message):
        parallelism.place_all(weights, rules, MESH)


def test_large_weights_may_go_unruled_when_nothing_is_split():
    placed = parallelism.place_all([W("emb/embeddings", (512, 128))], [], {"data": 8, "model": 1})
    assert placed[0].axes == (None, None)


class FakeDevice:  # what device_grid reads from a jax device off TPU
    def __init__(self, id, process_index):
        self.id, self.process_index, self.platform = id, process_index, "cpu"


def test_slices_take_consecutive_blocks_of_the_outer_data_axis():
    # 2 slices x 2 hosts x 2 devices, listed out of order: hosts 0-1 are slice 0, 2-3 slice 1.
    devices = [FakeDevice(i, i // 2) for i in (7, 2, 5, 0, 3, 6, 1, 4)]
    grid = mesh.device_grid(devices, 2, 2, 2, 1, 1, 1)
    assert grid.shape == (4, 2, 1, 1, 1)
    assert [[d.id for d in row.flat] for row in grid] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.describe({"data": 2, "fsdp": 1, "expert": 2, "model": 1}) == "data=2 x expert=2 x model=1"
    assert mesh.batch_splits({"data": 2, "fsdp": 1, "expert": 2, "model": 2}) == 4
    assert [mesh.slice_of_row(r, {"data": 2}) for r in range(4)] == [0, 0, 1, 1]
    assert mesh.batch_splits({"slices": 2, "data": 2, "fsdp": 2, "model": 1}) == 8
    assert mesh.describe({"slices": 2, "data": 2, "fsdp": 1, "model": 1}) == "slices=2 x data=2 x model=1"


@pytest.mark.parametrize("axes, slices, message", [
    ((None, "slices"), 2, "splits weights over mesh axis 'slices' but weights are never split across slices"),
    (("data", None), 2, "'data', which spans the 2 slices,"),
])
def test_a_rule_may_not_split_weights_across_slices(axes, slices, message):
    with pytest.raises(UserError, match=message) as raised:
        parallelism.place_all([W("d0/kernel", (4, 4))], [parallelism.Rule("d0/kernel", axes)],
                              {"slices": slices, "data": 2, "fsdp": 2, "model": 1})
    assert "name 'fsdp' or 'model'" in str(raised.value), str(raised.value)


def test_slices_alone_need_no_rules_and_data_rules_stay_on_one_slice():
    many = {"slices": 2, "data": 2, "fsdp": 1, "model": 1}
    assert parallelism.place_all([W("emb/embeddings", (512, 128))], [], many)[0].axes == (None, None)
    one = {"slices": 1, "data": 2, "fsdp": 1, "model": 1}  # keras-hub's maps may name 'data'
    rule = parallelism.Rule("d0/kernel", ("data", None))
    assert parallelism.place_all([W("d0/kernel", (4, 4))], [rule], one)[0].axes == ("data", None)


class FakeTpuChip:  # what JAX's mesh_utils reads from a TPU device, as in JAX's own tests
    platform, device_kind, core_on_chip = "tpu", "TPU v4", 0

    def __init__(self, id, coords, slice_index):
        self.id, self.coords, self.slice_index = id, coords, slice_index
        self.process_index = id // 4


def test_on_a_tpu_slices_come_from_the_devices_and_each_is_laid_out_by_its_topology():
    # Two v4-16 slices: 2x2x2 chips each, by the devices' own slice_index.
    chips = [FakeTpuChip(8 * s + 4 * z + 2 * y + x, (x, y, z), s)
             for s in (1, 0) for z in (0, 1) for y in (0, 1) for x in (0, 1)]
    grid = mesh.device_grid(chips, 2, 2, 2, 1, 1, 2)
    assert grid.shape == (4, 2, 1, 1, 2)
    assert [{d.slice_index for d in row.flat} for row in grid] == [{0}, {0}, {1}, {1}]
    assert sorted(d.id for d in grid.flat) == list(range(16))
    with pytest.raises(UserError, match="TPU devices are in 2 slice\\(s\\) but mesh.slices=1"):
        mesh.device_grid(chips, 1, 4, 2, 1, 1, 2)


def test_an_expert_axis_splits_the_batch_and_needs_the_jax_engine():
    assert mesh.AXES[-1] == "model" and "expert" in mesh.BATCH_AXES
    assert mesh.resolve({"data": -1, "expert": 2}, 8) == {"slices": 1, "data": 4, "fsdp": 1,
                                                           "expert": 2, "context": 1, "model": 1}
    two_slices = mesh.resolve({"slices": 2, "expert": 2, "model": 2}, 16)
    assert two_slices == {"slices": 2, "data": 2, "fsdp": 1, "expert": 2, "context": 1, "model": 2}
    assert mesh.batch_splits(two_slices) == 8
    assert mesh.describe(two_slices) == "slices=2 x data=2 x expert=2 x model=2"
    assert mesh.describe({"data": 8, "fsdp": 1, "expert": 1, "model": 1}) == "data=8 x model=1"
    with pytest.raises(UserError, match=r"mesh.expert=2 needs the jax engine \(--config.engine=jax\)"):
        mesh.resolve({"expert": 2}, 4, "tf")
    with pytest.raises(UserError, match="does not fit 8 devices.*use mesh.expert=2 or 4"):
        mesh.resolve({"data": -1, "expert": 3}, 8)
    # A job on fewer devices keeps as much of the run's expert axis as they and the batch allow.
    assert mesh.refit({"data": 4, "expert": 4, "model": 2}, 4, 64) == {
        "slices": 1, "data": 1, "fsdp": 1, "expert": 2, "context": 1, "model": 2}
    assert mesh.refit({"data": 2, "fsdp": 2, "expert": 2}, 8, 2) == {
        "slices": 1, "data": 1, "fsdp": 1, "expert": 2, "context": 1, "model": 1}


def test_the_grid_has_the_five_axes_and_expert_rows_split_the_batch():
    # 2 hosts x 4 devices, data=2 x expert=2 x model=2: the batch rows are data x expert.
    devices = [FakeDevice(i, i // 4) for i in (5, 0, 7, 2, 4, 1, 6, 3)]
    grid = mesh.device_grid(devices, 1, 2, 1, 2, 1, 2)
    assert grid.shape == (2, 1, 2, 1, 2)
    assert [[d.id for d in pair] for pair in grid.reshape(-1, 2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    rows = mesh.batch_rows(grid, 2)
    assert rows == {0: (0, 1), 1: (2, 3)}
    assert mesh.pipelines(rows) == {0: (2, 0), 1: (2, 1)}
    assert mesh.feed_rows(rows, 8) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    resolved = mesh.resolve({"data": -1, "expert": 2, "model": 2}, 8)
    assert mesh.grid_of(devices, resolved).shape == grid.shape
    # Two slices: each a (data, fsdp, expert, context, model) block of the outer data axis.
    many = [FakeDevice(i, i // 2) for i in range(16)]
    sliced = mesh.grid_of(many, {"slices": 2, "data": 2, "fsdp": 1, "expert": 2, "model": 2})
    assert sliced.shape == (4, 1, 2, 1, 2)
    assert [sorted(d.id for d in row.flat) for row in sliced] == [list(range(4 * r, 4 * r + 4))
                                                                  for r in range(4)]
    with pytest.raises(TypeError, match="one slice's sizes of .*'expert'"):
        mesh.device_grid(devices, 1, 4, 1, 1, 2)  # the four sizes of before: refused, not guessed


def test_a_context_axis_splits_sequences_not_weights_and_its_devices_hold_the_same_rows():
    assert mesh.AXES[-2:] == ("context", "model") and "context" not in mesh.BATCH_AXES
    resolved = mesh.resolve({"data": -1, "fsdp": 2, "context": 2}, 8)
    assert resolved == {"slices": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 2, "model": 1}
    assert mesh.batch_splits(resolved) == 4 and mesh.row_devices(resolved) == 2
    assert mesh.describe(resolved) == "data=2 x fsdp=2 x context=2 x model=1"
    # 2 hosts x 4 devices, data=2 x context=2 x model=2: a row's context and model devices
    # (one host's) hold the same examples.
    devices = [FakeDevice(i, i // 4) for i in range(8)]
    grid = mesh.device_grid(devices, 1, 2, 1, 1, 2, 2)
    rows = mesh.batch_rows(grid, mesh.row_devices({"context": 2, "model": 2}))
    assert rows == {0: (0,), 1: (1,)} and mesh.pipelines(rows) == {0: (2, 0), 1: (2, 1)}
    assert mesh.refit({"data": 2, "context": 4}, 4, 8)["context"] == 4
    with pytest.raises(UserError, match="'context', which splits sequences, not weights"):
        parallelism.place_all([W("d0/kernel", (4, 4))], [parallelism.Rule("d0/kernel", ("context", None))],
                              {"data": 1, "fsdp": 1, "context": 2, "model": 1})
    # A large weight on a mesh that splits only batches and sequences needs no rule.
    placed = parallelism.place_all([W("emb/embeddings", (512, 256))], [],
                                   {"data": 2, "fsdp": 1, "context": 2, "model": 1})
    assert placed[0].axes == (None, None)


EXPERT_GRID_ON_A_TPU = """
import json
from tpu_keras.cluster import libtpu
from tpu_keras.parallelism import mesh
chips = libtpu.devices("v5litepod-16")  # 4 x 4 chips, 4 hosts of 2 x 2
grid = mesh.device_grid(chips, 1, 4, 1, 2, 1, 2)
rows = mesh.batch_rows(grid, 2)
two = mesh.device_grid(libtpu.devices("2xv5litepod-8"), 2, 2, 1, 2, 1, 2)
print("GRID " + json.dumps({
    "shape": grid.shape, "chips": sorted(d.id for d in grid.flat),
    "model_pairs": [[list(d.coords) for d in pair] for pair in grid.reshape(-1, 2)],
    "rows": {str(p): list(r) for p, r in rows.items()}, "pipelines": mesh.pipelines(rows),
    "fed": sorted(i for fed in mesh.feed_rows(rows, 16).values() for i in fed),
    "two_slices": [two.shape, [sorted({d.slice_index for d in row.flat}) for row in two]]}))
"""


def test_on_libtpus_slices_the_expert_axis_is_laid_out_and_model_stays_on_neighbours():
    import json
    import sys
    from conftest import run_command
    output = run_command([sys.executable, "-c", EXPERT_GRID_ON_A_TPU], timeout=120,
                         env={"TPU_SKIP_MDS_QUERY": "1"}, merge_stderr=False).stdout
    found = json.loads(next(line for line in output.splitlines() if line.startswith("GRID "))[5:])
    assert found["shape"] == [4, 1, 2, 1, 2] and found["chips"] == list(range(16))
    for a, b in found["model_pairs"]:  # the last axis on chips one link apart
        assert sum(abs(x - y) for x, y in zip(a, b)) == 1, found["model_pairs"]
    held = sorted(row for rows in found["rows"].values() for row in rows)
    assert held == list(range(8))  # data 4 x expert 2 batch rows, each held by one host
    assert {tuple(p) for p in found["pipelines"].values()} == {(4, i) for i in range(4)}
    assert found["fed"] == list(range(16))
    assert found["two_slices"] == [[4, 1, 2, 1, 2], [[0], [0], [1], [1]]]


def test_rules_may_split_experts_over_the_expert_axis_which_needs_rules_above_1():
    experts = {"data": 2, "fsdp": 1, "expert": 4, "model": 1}
    rule = parallelism.Rule(r"moe/gate", ("expert", None, None))
    placed = parallelism.place_all([W("moe/gate", (8, 16, 32))], [rule], experts)
    assert placed[0].axes == ("expert", None, None) and placed[0].shard_shape(experts) == (2, 16, 32)
    with pytest.raises(UserError, match=r"dimension 0 \(6\) does not divide by mesh axis 'expert' \(4\)"):
        parallelism.place_all([W("moe/gate", (6, 16, 32))], [rule], experts)
    # Not an axis of the batch alone: a large weight no rule covers is refused, as under model.
    with pytest.raises(UserError, match="covered by no layout rule; add a rule that shards it, or"):
        parallelism.place_all([W("moe/gate", (8, 16, 32)), W("emb/embeddings", (512, 128))], [rule],
                              experts)
