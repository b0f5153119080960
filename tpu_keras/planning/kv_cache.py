"""What GRPO's sampler holds on each device while it completes a batch: the KV cache.

A keras-hub causal LM samples through its cache (`models.grpo_sampling`):
for every row, every layer keeps a key and a value per position of the
context, `rows x layers x 2 x context x key/value heads x head size`
elements in the compute dtype, and each step's logits, `rows x vocabulary`
in float32. The rows are the per-replica batch (completions, G per prompt);
the heads split over the mesh's model axis where it divides them, as the
attention's projections do. The `gpt` builder has no cache: it recomputes
the sequence at each step, a forward pass's activations, which the training
step's exceed. Sampling and the training step do not run at once, so the plan
counts the larger of the two.
"""

from tpu_keras.models import export


def cache_bytes(model, rows: int, context: int, model_axis: int, itemsize: int) -> int:
    """Bytes per device of the sampler's cache and logits for `rows` rows; 0 without a cache."""
    task = export.find_task(model)
    backbone = getattr(task, "backbone", None)
    if backbone is None or not hasattr(backbone, "num_layers"):
        return 0
    query_heads = getattr(backbone, "num_query_heads", None) or backbone.num_heads
    heads = getattr(backbone, "num_key_value_heads", None) or query_heads
    head_size = getattr(backbone, "head_dim", None) or backbone.hidden_dim // query_heads
    if heads % model_axis == 0:
        heads //= model_axis
    cache = rows * backbone.num_layers * 2 * context * heads * head_size * itemsize
    logits = rows * backbone.vocabulary_size * 4
    return int(cache + logits)
