"""A byte-level GPT on the Python standard library's own source, fully offline.

    python -m tpu_keras.train --config=configs/lm_stdlib.py --workdir=/tmp/lm
    python -m tpu_keras.train --config=configs/lm_stdlib.py:tiny --workdir=/tmp/lm_tiny

Variants: '' (a few minutes on a 2-core CPU, validation < 3.2 bits per byte),
'tiny' (seconds; for tests and for checking a cluster end to end) and 'wide'
(width 256, depth 4: 2.5 GFLOP per sequence, about the size the design
brief's figures for its "small GPT" imply; matmuls weigh more in its step, so
it shows how the fraction of the matmul ceiling grows with width on a CPU -
see docs/performance.md) and '1b' (about a billion parameters, a pod's
model for `python -m tpu_keras.plan --auto`; never trained here).
"""

from tpu_keras.config import defaults


def get_config(arg=None):
    config = defaults()
    config.data.tfds.name = "stdlib_bytes/ctx128"
    config.data.preprocess = "next_token"
    config.model = dict(name="gpt", vocab_size=256, context_length=128,
                        width=128, depth=2, num_heads=4, mlp_ratio=4)

    config.train.batch_size = 32
    config.train.steps = 800
    config.train.learning_rate = 3e-3
    config.train.warmup_steps = 50
    config.train.jit_compile = True   # measured faster for this model (docs/performance.md)
    config.train.eval_every = 400
    config.train.eval_steps = 50
    config.checkpoint.every_steps = 200
    config.log.every_steps = 100

    if arg == "tiny":
        config.data.tfds.name = "stdlib_bytes/ctx64"
        config.model.update(context_length=64, width=32, depth=1, num_heads=2)
        config.train.update(batch_size=16, steps=20, warmup_steps=5, eval_every=10,
                            eval_steps=2, steps_per_execution=5, jit_compile=False)
        config.checkpoint.every_steps = 10
        config.log.every_steps = 10
    elif arg == "wide":
        config.model.update(width=256, depth=4, num_heads=4)
    elif arg == "1b":
        # About a billion parameters (1.01e9: 20 blocks of 12 x 2048^2), for planning a pod
        # run (python -m tpu_keras.plan --auto); never trained here. 512 sequences of
        # 2,048 bytes per update, about a million tokens.
        config.data.tfds.name = "stdlib_bytes/ctx2048"
        config.model.update(context_length=2048, width=2048, depth=20, num_heads=16)
        config.engine = "jax"
        config.train.update(batch_size=512, learning_rate=3e-4, warmup_steps=200, steps=10_000)
    elif arg:
        raise ValueError(f"unknown variant {arg!r} of lm_stdlib; use '', 'tiny', 'wide' or '1b'")
    return config
