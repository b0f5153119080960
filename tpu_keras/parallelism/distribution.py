"""The jax engine's `keras.distribution`, built from a model's layout rules.

Keras on JAX lays weights out through one process-wide
`keras.distribution`. `set_layout` sets the one a placer's rules give:
`DataParallel` when the mesh does not split weights, otherwise
`ModelParallel` with the rules as its `LayoutMap`. Both check each weight
against the rules as Keras creates it, before any memory is allocated for
it, so a bad rule fails with one line instead of a JAX shape error or a
silently replicated weight (Keras replicates a weight no `LayoutMap` key
matches, without a word: docs/design.md). The tf engine has nothing to set:
Keras 3's TensorFlow backend ignores layouts.
"""

import keras

from tpu_keras.parallelism.rules import Placer, dtype_name


def set_layout(cluster, placer: Placer) -> None:
    """Sets the global Keras distribution: `cluster`'s jax mesh, `placer`'s layout rules."""
    if cluster.mesh["model"] == 1:
        data_mesh = keras.distribution.DeviceMesh(
            (cluster.mesh["data"],), ["data"], cluster.device_mesh.devices.reshape(-1).tolist())
        distribution = _CheckedDataParallel(placer, device_mesh=data_mesh, auto_shard_dataset=False)
    else:
        layout_map = keras.distribution.LayoutMap(cluster.device_mesh)
        for rule in placer.rules:
            layout_map[rule.pattern] = tuple(rule.axes)
        distribution = _CheckedModelParallel(placer, layout_map=layout_map, batch_dim_name="data",
                                             auto_shard_dataset=False)
    # auto_shard_dataset=False: tpu_keras.data already gives each process its own rows.
    keras.distribution.set_distribution(distribution)


class _Checked:
    """Checks each new variable against the rules before Keras lays it out."""

    def __init__(self, placer: Placer, **kwargs):
        super().__init__(**kwargs)
        self.placer = placer

    def get_variable_layout(self, variable):
        self.placer.place(variable.path, variable.shape, dtype_name(variable.dtype))
        return super().get_variable_layout(variable)


class _CheckedDataParallel(_Checked, keras.distribution.DataParallel):
    pass


class _CheckedModelParallel(_Checked, keras.distribution.ModelParallel):
    pass
