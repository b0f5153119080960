"""Per-platform training defaults: precision and steps per execution.

The choices `auto` makes, and why (figures: docs/performance.md):

- TPU: `mixed_bfloat16`, since the MXU multiplies bf16 natively and the
  published peak is a bf16 peak; and one execution per log interval, since a
  TPU step is short and every return to Python idles the chips. TPUStrategy
  compiles every step with XLA whatever `train.jit_compile` says.
- CPU and GPU: float32, since XLA's CPU code runs bf16 no faster than
  float32 (even where the CPU has bf16 units), so bf16 would cost precision
  and buy nothing; and 10 steps per call, past which the host loop no longer
  shows in a step's time. XLA is each config's measured choice
  (`train.jit_compile`).
"""

import math

from tpu_keras import objectives

CPU_STEPS_PER_EXECUTION = 10
TPU_STEPS_PER_EXECUTION = 100  # without a log interval to match


def precision(train_cfg, platform: str) -> str:
    """The Keras dtype policy name a run trains in on `platform` ('tpu', 'gpu', 'cpu': a
    cluster's `kind`); `train.precision` is checked by `config`. The planner asks for 'tpu'."""
    if train_cfg.precision != "auto":
        return train_cfg.precision
    return "mixed_bfloat16" if platform == "tpu" else "float32"


def compute_dtype(policy: str) -> str:
    """The dtype the matmuls run in under `policy`: what the MFU peak is for."""
    return "bfloat16" if "bfloat16" in policy else "float32"


def steps_per_execution(train_cfg, cluster, log_every_steps: int = 0) -> int:
    """`train.steps_per_execution`, or with 0 (auto) the platform's choice.

    Auto always divides `log_every_steps` when given, so it never conflicts
    with logging.
    """
    if train_cfg.steps_per_execution:
        return train_cfg.steps_per_execution
    if cluster.kind == "tpu":
        return log_every_steps or TPU_STEPS_PER_EXECUTION
    return math.gcd(CPU_STEPS_PER_EXECUTION, log_every_steps or CPU_STEPS_PER_EXECUTION)


def resolve(config, cluster) -> dict:
    """The `train` keys whose `auto` this platform decides, {precision, steps_per_execution},
    with their values here: the run's resolved config takes them (`training.run_config`),
    so the config written to the workdir says what actually ran."""
    per_execution = steps_per_execution(config.train, cluster, config.log.every_steps)
    per_execution = objectives.of(config).steps_per_execution(per_execution)  # GRPO's: 1
    return {"precision": precision(config.train, cluster.kind), "steps_per_execution": per_execution}
