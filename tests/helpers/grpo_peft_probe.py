"""A GRPO run's PEFT adapter against the run itself: prints `PEFT {json}` with the largest
difference between the logits of the run's final checkpoint (its policy, on jax) and
transformers' model of DIR/export/peft_base with PEFT's `PeftModel` reading DIR/export/peft.

    python grpo_peft_probe.py WORKDIR
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tpu_keras import config as config_lib  # noqa: E402
from tpu_keras.cluster import engine  # noqa: E402

engine.select("jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hf_checkpoints  # noqa: E402
from tpu_keras.models import preference  # noqa: E402
from tpu_keras.training import restored  # noqa: E402

workdir = sys.argv[1]
run, step = restored.load(workdir, config_lib.read_run_config(workdir), purpose="generate")
policy = preference.policy_of(run.model)
tokens = np.array([[ord(c) for c in text.ljust(16, "\0")] for text in ("17+25=42", "3+4=7", "49+0=")],
                  "int32")
ours = keras.ops.convert_to_numpy(policy(tokens))
theirs = hf_checkpoints.transformers_logits(os.path.join(workdir, "export", "peft_base"), tokens,
                                            adapter=os.path.join(workdir, "export", "peft"))
base = hf_checkpoints.transformers_logits(os.path.join(workdir, "export", "peft_base"), tokens)
print("PEFT " + json.dumps({"step": step, "gap": float(np.abs(ours - theirs).max()),
                            "adapter_moves_logits": float(np.abs(theirs - base).max())}), flush=True)
