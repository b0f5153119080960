"""Checks on what `tests/helpers/mesh_probe.py` reports: the arrays laid out as the Placer said,
and the same losses as on one device."""


def assert_laid_out_as_placed(result):
    """Every weight's array is split as its placement says; returns how many are split."""
    mesh, split = result["mesh"], 0
    for path, weight in result["weights"].items():
        # An axis of size 1 splits nothing: the same as None.
        axes = [a if a and mesh[a] > 1 else None for a in result["expected"][path]]
        spec = weight["spec"] + [None] * (len(axes) - len(weight["spec"]))
        assert [a if a and mesh[a] > 1 else None for a in spec] == axes, path
        assert weight["shard_shape"] == [n // mesh[a] if a else n for n, a in zip(weight["shape"], axes)], path
        split += weight["shard_shape"] != weight["shape"]
    return split


def assert_same_losses(result, reference):
    assert len(result["losses"]) == len(reference["losses"]) == 5
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
        assert abs(got - want) <= 1e-4, (step, result["losses"], reference["losses"])
