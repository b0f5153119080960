"""`layout.split_logits`: a causal LM's logits split over the vocabulary under fsdp.

Under fsdp alone (a model axis of 1) the output head, hidden x vocabulary,
is split over fsdp along the vocabulary, and each layer's output is held to
the batch split (`parallelism.distribution`). For the head that means every
device gathers the whole table for the step, in float32 where the head
computes in float32 (Keras's embeddings under mixed_bfloat16), and keeps it
for the backward pass: 4.2 GB per device for Llama 3's 128,256 x 8,192.

With `layout.split_logits`, the logits are held split over the vocabulary
instead: each device gathers the step's last hidden states (tokens x
hidden) and multiplies them by its own slice of the head; the loss then
reduces across the vocabulary. It pays where a step has fewer tokens than
the vocabulary has entries, as in fine-tuning; a pretraining step of a
million tokens would gather more than the table.
"""

import keras


@keras.saving.register_keras_serializable(package="tpu_keras")
class LogitsOverVocabulary(keras.layers.Layer):
    """Holds its input, the logits, split over the vocabulary, where the distribution in force
    says so (a copy of the model built elsewhere, on the host for an export, passes them on)."""

    def call(self, logits):
        layout = getattr(keras.distribution.distribution(), "vocabulary_layout", lambda: None)()
        if layout is None or len(logits.shape) != 3:  # a chunked head's per-token loss (chunked_loss)
            return logits
        return keras.distribution.distribute_tensor(logits, layout)


def split(logits, task, wrappers=()):
    """`logits`, the output of keras-hub causal LM `task` (called inside the layers or model
    named `wrappers`), held split over the vocabulary where the run's distribution says so
    (`layout.split_logits`)."""
    placed = keras.distribution.distribution()
    if getattr(placed, "vocabulary_layout", lambda: None)() is None:  # tf; not asked for
        return logits
    name = "logits_over_vocabulary"
    head = task.backbone.token_embedding  # keras-hub's ReversibleEmbedding: the table and the head
    placed.free_outputs([head.path, task.path, name, *wrappers])
    return LogitsOverVocabulary(name=name)(logits)
