"""GRPO, offline: a small Llama learns to complete sums ('17+25=') that a program checks.

    python -m tpu_keras.train --config=configs/grpo_stdlib.py:sft --workdir=/tmp/arithmetic_sft
    python -m tpu_keras.train --config=configs/grpo_stdlib.py --workdir=/tmp/grpo
    python -m tpu_keras.train --config=configs/grpo_stdlib.py:tiny --workdir=/tmp/grpo_tiny

The first command is the warm start, and it comes first: both GRPO runs read
its preset from the folder beside their own workdir
(`{workdir}/../arithmetic_sft/export/keras_hub`), ':tiny' too. A GRPO run
that finds none there stops with one line that names the ':sft' command to
run first, its --workdir that folder (model.preset_written_by).

Needs the 'hub' and 'jax' extras. The prompts are generated
(tpu_keras.data.arithmetic writes them under data.data_dir on first use), each
line a prompt and its `answer`; two reward functions of
configs/arithmetic_rewards.py score each completion: `correct` (1 for the sum
itself) and `close` (partial credit for a near miss). The model is
llama_stdlib's byte-level Llama: ':sft' trains it from scratch on the sums with
their answers written out (the warm start), and GRPO trains a LoRA of that
preset, an offline stand-in for a downloaded checkpoint (point model.preset at
a real one; with beta above 0 its base is the reference, with no second
copy). The mesh splits the weights over fsdp x model, on 4 CPU devices here.

The log gives the mean reward and each function's, and evaluation the same
over the validation prompts with one fixed random stream; docs/fine_tuning.md
("GRPO") shows the curve. '' trains longer than 'tiny' (for tests).

For your own task, point data.prompts.files (and .eval_files) at .jsonl files
of {"prompt": ...} lines with whatever fields your reward functions read, and
grpo.rewards at your functions ('my_rewards:is_correct', or a file's path).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_stdlib  # noqa: E402  (a sibling config file)

REWARDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic_rewards.py")
# Where the warm start's preset is: the :sft run in a folder beside this run's.
SFT_WORKDIR = "{workdir}/../arithmetic_sft"
SFT_PRESET = SFT_WORKDIR + "/export/keras_hub"


def sft_command() -> str:
    """The warm start's command, which a GRPO run without its preset names: this file as
    seen from the folder the run started in ('configs/grpo_stdlib.py' from the repository)."""
    here = os.path.relpath(os.path.abspath(__file__))
    if here.startswith(os.pardir):
        here = os.path.abspath(__file__)
    return f"python -m tpu_keras.train --config={here}:sft --workdir={SFT_WORKDIR}"


def get_config(arg=None):
    if arg not in (None, "", "tiny", "sft"):
        raise ValueError(f"unknown variant {arg!r} of grpo_stdlib; use '', 'tiny' or 'sft'")
    config = llama_stdlib.get_config("tiny")
    sums = "{data_dir}/arithmetic"  # '{data_dir}': data.data_dir
    config.engine = "jax"
    config.cluster.virtual_devices = 4
    config.mesh.update(data=1, fsdp=2, model=2)
    config.data.tfds.name = ""  # llama_stdlib's text: sums instead
    config.data.preprocess = ""
    config.model.update(name="keras_hub:Llama3CausalLM", context_length=16, num_layers=2,
                        hidden_dim=64, intermediate_dim=128, num_query_heads=4)
    config.train.update(steps_per_execution=0, warmup_steps=10)
    if arg == "sft":  # the warm start: a full fine-tune on the sums and their warm_start answers
        config.data.instructions.update(files=f"{sums}/train/*.jsonl", response_field="warm_start",
                                        eval_files=f"{sums}/validation/*.jsonl")
        config.train.update(batch_size=64, steps=300, learning_rate=1e-2, eval_every=300)
        config.checkpoint.every_steps = 300
        config.log.every_steps = 100
        config.export.formats = ("keras_hub",)
        return config
    config.data.prompts.update(files=f"{sums}/train/*.jsonl", eval_files=f"{sums}/validation/*.jsonl")
    config.model.update(preset=SFT_PRESET, preset_written_by=sft_command(), lora_rank=8)
    config.grpo.update(num_generations=8, max_completion_length=4,
                       rewards=(f"{REWARDS}:correct", f"{REWARDS}:close"), beta=0.04)
    config.train.update(batch_size=64, steps=200, learning_rate=1e-2, eval_every=50)
    config.checkpoint.every_steps = 50
    config.log.every_steps = 10
    config.export.formats = ("peft",)
    if arg == "tiny":
        config.train.update(steps=40, eval_every=20)
        config.checkpoint.every_steps = 20
    return config
