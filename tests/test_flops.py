"""FLOPs counted from a model's layers equal a count by hand (MaxText's convention)."""

from tpu_keras import models
from tpu_keras.measurement import flops


def build(**model_config):
    builder, kwargs = models.registry.get(model_config)
    return builder.make(**kwargs)


def test_gpt_training_flops_match_a_hand_count():
    L, W, F, V = 16, 32, 128, 256  # context, width, MLP width, vocabulary
    model = build(name="gpt", vocab_size=V, context_length=L, width=W, depth=1, num_heads=2)
    matmul_params = 4 * W * W + 2 * W * F + W * V  # Q, K, V, out; MLP up, down; head
    attention = 2 * 2 * L * L * W // 2              # scores and context, causal: half
    hand = 3 * (2 * L * matmul_params + attention)  # forward + backward (2 forwards)
    assert flops.training_flops_per_example(model) == hand == 2_015_232


def test_mlp_and_cnn_training_flops_match_a_hand_count():
    mlp = build(name="mlp", width=256, depth=2)
    assert flops.training_flops_per_example(mlp) == 3 * 2 * (64 * 256 + 256 * 256 + 256 * 10)
    cnn = build(name="cnn", channels=(32, 64), width=128)
    positions = 8 * 8  # 'same' padding, stride 1
    convs = 2 * 9 * positions * (1 * 32 + 32 * 64)
    dense = 2 * (positions * 64 * 128 + 128 * 10)
    assert flops.training_flops_per_example(cnn) == 3 * (convs + dense)
