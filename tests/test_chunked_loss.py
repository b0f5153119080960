"""`train.loss_chunks` (tpu_keras/models/chunked_loss.py): the head and the cross-entropy in
pieces of the sequence give the whole logits' loss and gradients. Here keras-hub's head, a
`ReversibleEmbedding` (tied and untied, with Gemma's soft cap and a float32 reverse product),
on the tf engine of the test process; whole steps on both engines, split over replicas and
micro-batches under the token mean: tests/test_accumulation.py."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tpu_keras.models import chunked_loss


@pytest.mark.parametrize("tied, cap, reverse_dtype", [(True, None, None), (False, None, None),
                                                      (True, 30.0, "float32")],
                         ids=["tied", "untied", "soft-cap-float32"])
def test_a_reversible_embedding_in_pieces_gives_the_whole_logits_loss_and_gradients(tied, cap, reverse_dtype):
    keras.utils.set_random_seed(0)
    head = keras.layers.ReversibleEmbedding(48, 16, tie_weights=tied, logit_soft_cap=cap,
                                            reverse_dtype=reverse_dtype)
    head.build((None,))
    hidden = tf.constant(np.random.default_rng(0).normal(size=(3, 12, 16)) * 4, tf.float32)
    labels = tf.constant(np.random.default_rng(1).integers(0, 48, (3, 12)), tf.int32)
    table = head.trainable_variables

    def losses(chunked: bool):
        with tf.GradientTape() as tape:
            tape.watch(hidden)
            if chunked:
                weights, logits_of = chunked_loss._head_function(head)
                nll = chunked_loss.per_token_nll(logits_of, hidden, labels, weights, chunks=4)
            else:
                nll = keras.ops.sparse_categorical_crossentropy(labels, head(hidden, reverse=True),
                                                                from_logits=True)
            total = tf.reduce_sum(nll * tf.linspace(0.1, 1.0, 12))  # unequal weights per position
        return nll, tape.gradient(total, [hidden] + [v.value for v in table])

    (whole, whole_grads), (pieces, piece_grads) = losses(False), losses(True)
    assert pieces.shape == (3, 12)
    np.testing.assert_allclose(pieces, whole, rtol=1e-6)
    for a, b in zip(piece_grads, whole_grads):
        if a is None and b is None:  # the untied table's forward half: not in the head
            continue
        assert float(tf.reduce_max(tf.abs(a - b))) <= 1e-6 * float(tf.reduce_max(tf.abs(b))), (a, b)


def test_a_model_without_a_known_head_refuses_chunks_in_one_line():
    from tpu_keras.errors import UserError
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(3, name="classifier")(inputs), name="mine")
    assert not chunked_loss.attach(model, 1)  # one piece: nothing to route
    with pytest.raises(UserError, match="train.loss_chunks=2 .* mine has none .* set train.loss_chunks=1"):
        chunked_loss.attach(model, 2)


def test_dpo_and_grpo_scores_through_a_chunked_head_are_the_whole_logits_scores():
    """DPO's pairs and GRPO's groups read each token's log-probability from the routed head's
    pieces (GRPO's under its sampling temperature), with the gradients of the whole logits."""
    from tpu_keras.models import gpt, grpo, preference

    def policy(chunks):
        keras.utils.set_random_seed(0)
        model = gpt.gpt(vocab_size=64, context_length=16, width=16, depth=1, num_heads=2)
        chunked_loss.attach(model, chunks)
        return model

    tokens = tf.constant(np.random.default_rng(2).integers(0, 64, (4, 17)), tf.int32)
    with chunked_loss.targets(tokens[:, 1:]):  # the routed head gives each token's loss
        assert policy(4)(tokens[:, :-1]).shape == (4, 16) and policy(1)(tokens[:, :-1]).shape == (4, 16, 64)
    pairs = {"tokens": tf.reshape(tokens[:, :], (2, 2, 17)), "mask": tf.ones((2, 2, 17))}
    scores, gradients = {}, {}
    for chunks in (1, 4):
        group = grpo.GroupModel(policy(chunks), with_reference=False, temperature=0.7)
        pair = preference.PairsModel(policy(chunks), reference=policy(1))
        with tf.GradientTape() as tape:
            scores[chunks] = (group(tokens), pair(pairs))
            total = tf.reduce_sum(scores[chunks][0]) + tf.reduce_sum(scores[chunks][1])
        gradients[chunks] = tape.gradient(total, group.policy.trainable_variables
                                          + pair.policy.trainable_variables)
    for whole, pieces in zip(scores[1], scores[4]):
        np.testing.assert_allclose(pieces, whole, rtol=1e-6)
    for a, b in zip(gradients[4], gradients[1]):  # the embeddings' come as IndexedSlices
        a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
        assert float(tf.reduce_max(tf.abs(a - b))) <= 1e-6 * max(float(tf.reduce_max(tf.abs(b))), 1e-12)
