"""The jax engine's `keras.distribution`, built from a model's layout rules.

Keras on JAX lays weights out through one process-wide
`keras.distribution`. `set_layout` sets one whose every decision comes from
a `Placer`: each weight gets the placement the rules (and, with `fsdp`
above 1, fully-sharded data parallelism) give it, checked as Keras creates
the weight and before any memory is allocated for it, so a bad rule fails
with one line instead of a JAX shape error or a silently replicated weight
(Keras replicates a weight no `LayoutMap` key matches, without a word:
docs/design.md). The batch is split over `data`, `fsdp` and `expert` together
(`mesh.BATCH_AXES`; a mixture of experts' layer splits its experts over
`expert` and exchanges tokens along it itself, `models.moe`).

Keras's distributions take one batch axis name, and its `TensorLayout`
checks each dimension's entry as one axis name, while JAX's
`PartitionSpec` takes a tuple of axes for one dimension. `_Layout` is a
`TensorLayout` that allows such a tuple, so the batch dimension can span
('data', 'fsdp', 'expert') and Keras still hands JAX a plain `NamedSharding`. The tf
engine has nothing to set: Keras 3's TensorFlow backend ignores layouts.
"""

# Imported inside functions: Keras's private distribution_lib, where its one function is
# replaced (`_place_each_tensor_of_a_structure`), not read by anything else here.
import re

import keras

from tpu_keras.parallelism.mesh import BATCH_AXES, CONTEXT
from tpu_keras.parallelism.rules import Placer, dtype_name

# The outputs of keras-hub's MoE blocks (with the router's: flattened tokens) and of the layers in
# them; Gemma 4's router and bank are layers of its decoder block, called on flattened tokens.
_INSIDE_EXPERTS = re.compile(r"(sparse_moe_block(_\d+)?|moe_router|moe_expert_bank)/(.+/)?output$")


def set_layout(cluster, placer: Placer) -> None:
    """Sets the global Keras distribution: `cluster`'s jax mesh, `placer`'s placements."""
    keras.distribution.set_distribution(placed(cluster, placer))


def placed(cluster, placer: Placer) -> keras.distribution.ModelParallel:
    """The distribution that puts weights where `placer` says, on `cluster`'s jax mesh.
    Its `scope()` (Keras's own) sets it, then restores the one it replaced."""
    _place_each_tensor_of_a_structure()
    # auto_shard_dataset=False: tpu_keras.data already gives each process its own rows.
    return _PlacedDistribution(placer, layout_map=keras.distribution.LayoutMap(cluster.device_mesh),
                               batch_dim_name=BATCH_AXES[0], auto_shard_dataset=False)


def _place_each_tensor_of_a_structure() -> None:
    """Keras 3.15 places a layer's output with `distribute_tensor(outputs, layout)`, which
    leaves a `KerasTensor` (a functional model's build) alone but hands a tuple of them to
    `jax.device_put`, which refuses them: a layer that returns (x, cache), such as Gemma 4's
    decoder block, could not be built where its output has a layout (an fsdp mesh's batch).
    Here each tensor of a structure is placed on its own; a tensor, as Keras places it."""
    from keras.src.distribution import distribution_lib
    keras_own = distribution_lib.distribute_tensor
    if getattr(keras_own, "_tpu_keras", False):
        return

    def distribute_tensor(tensor, layout):
        if isinstance(tensor, (tuple, list)):
            return type(tensor)(None if t is None else distribute_tensor(t, layout) for t in tensor)
        return keras_own(tensor, layout)

    distribute_tensor._tpu_keras = True
    distribution_lib.distribute_tensor = distribute_tensor


class _Layout(keras.distribution.TensorLayout):
    """A `TensorLayout` whose entries may be tuples of mesh axes, as in a JAX `PartitionSpec`."""

    def _validate_axes(self):
        if self.device_mesh is None:
            return
        names = {name for entry in self.axes if entry is not None
                 for name in (entry if isinstance(entry, tuple) else (entry,))}
        unknown = names - set(self.device_mesh.axis_names)
        if unknown:
            raise ValueError(f"mesh axes {sorted(unknown)} are not among {self.device_mesh.axis_names}")


class _PlacedDistribution(keras.distribution.ModelParallel):
    """Weights where the `Placer` puts them; the batch over `BATCH_AXES`."""

    def __init__(self, placer: Placer, **kwargs):
        super().__init__(**kwargs)
        self.placer = placer
        self.vocabulary_outputs: set[str] = set()  # `models.vocabulary_split`'s, left to it
        self.sequence_outputs: set[str] = set()  # `models.sequence_parallel`'s blocks

    def vocabulary_layout(self) -> keras.distribution.TensorLayout | None:
        """With `layout.split_logits` (`models.vocabulary_split`): logits split over the
        vocabulary, across fsdp (and their tokens over `context`); else None."""
        if not self.placer.split_logits:
            return None
        return _Layout((None, self._sequence(), "fsdp"), self.device_mesh)

    def _sequence(self):
        """The mesh axis a sequence is split over: `context` where it is above 1, else None."""
        return CONTEXT if self.placer.mesh.get(CONTEXT, 1) > 1 else None

    def split_sequence_at(self, paths) -> None:
        """Holds the outputs of the layers at `paths` (transformer blocks) split along the
        sequence over context x model (`layout.sequence_parallel`)."""
        self.sequence_outputs.update(f"{path}/output" for path in paths)

    def free_outputs(self, paths) -> None:
        """Leaves the outputs of the layers at `paths` to XLA: the logits' way to their split."""
        self.vocabulary_outputs.update(f"{path}/output" for path in paths)

    def get_variable_layout(self, variable):
        placement = self.placer.place(variable.path, variable.shape, dtype_name(variable.dtype))
        return _Layout(placement.axes or (None,) * len(variable.shape), self.device_mesh)

    def get_data_layout(self, data_shape):
        """The batch over `BATCH_AXES`; a sequence's tokens (the second dimension) over
        `context` where the mesh splits them."""
        sequence = (self._sequence(),) if len(data_shape) > 1 else ()
        return _Layout((BATCH_AXES,) + sequence + (None,) * (len(data_shape) - 1 - len(sequence)),
                       self.device_mesh)

    def get_tensor_layout(self, path):
        """Every layer's output keeps the batch split, when weights are split over fsdp alone.

        Keras asks for `<layer path>/output` after each layer call. Without a
        constraint, XLA may meet an fsdp-split weight by splitting the
        activations' features instead of gathering the weight, and then
        reshuffle and all-reduce activations: several times the memory and
        the traffic FSDP should cost (seen in the compiled step, docs/parallelism.md,
        "The check paid for itself"). With a `context` axis, the tokens too (every layer's
        output holds a sequence along its second dimension). With a model axis, layer
        outputs are split over it by the rules, so only the batch could be named; left to
        XLA. Inside a mixture
        of experts' block and in its outputs (gpt-oss's router scores) the tokens are
        flattened, of a length Keras's shape inference leaves unknown, and `models.moe`
        places them itself: left to it.
        """
        mesh = self.placer.mesh
        if path in self.vocabulary_outputs or _INSIDE_EXPERTS.search(path):
            return None
        if path in self.sequence_outputs:  # a block's output: its tokens over context x model
            tokens = (self._sequence(), "model") if self._sequence() else "model"
            return _Layout((BATCH_AXES, tokens, None), self.device_mesh)
        split = mesh.get("fsdp", 1) > 1 or mesh.get(CONTEXT, 1) > 1
        if path.endswith("/output") and split and mesh.get("model", 1) == 1:
            sequence = self._sequence()
            return _Layout((BATCH_AXES,) + ((sequence,) if sequence else ()), self.device_mesh)
        return None
