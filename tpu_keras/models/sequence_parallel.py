"""`layout.sequence_parallel`: the residual stream split along the sequence over `model`.

Under tensor parallelism alone each device of the model axis holds the whole
residual stream: every block's input and output, (batch, tokens, hidden), a
copy per device, and under `train.remat="blocks"` the copies the backward
pass keeps. Megatron's sequence parallelism splits those tensors along the
tokens over the model axis instead. Here each transformer block's output is
held split so (with `mesh.context`, over context x model), and each device
keeps its share of every block's input. What happens inside a block is left
to the compiler: it gathers the tokens before the column-parallel matmuls
(Megatron's way) or, where a weight is smaller than the tokens, the weight.
Holding the norms inside the blocks whole over `model` too, to force the
former, measured worse on the TPU compiler (docs/parallelism.md).
"""

import keras

from tpu_keras.models import block_remat


def apply(model) -> int:
    """Holds the output of each transformer block of `model` split along the sequence, where
    the run's distribution splits it (`parallelism.distribution`); returns how many blocks."""
    placed = keras.distribution.distribution()
    if not hasattr(placed, "split_sequence_at"):  # tf, or no distribution
        return 0
    found = block_remat.blocks(model)
    placed.split_sequence_at([block.path for block in found])
    return len(found)
