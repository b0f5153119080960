"""Bad input ends in one line that says what to change, a non-zero exit and no traceback."""

import json
import re
import shutil
import sys

import pytest

from conftest import assert_one_line_error, run_command, run_in_one_process, train, train_args
from tpu_keras.errors import UserError

LM_TINY = "configs/lm_stdlib.py:tiny"
DIGITS_TINY = "configs/digits.py:tiny"
DATA = "--config.data.data_dir={data_dir}"
LLAMA_TINY = "configs/llama_stdlib.py:tiny"
# llama_stdlib:tiny as a LoRA DPO run on the pairs file {} of the inputs below.
DPO_PAIRS = ("--config.data.tfds.name= --config.data.preprocess= "
             "--config.model.lora_rank=4 --config.data.preferences.files={{inputs}}/{0}.jsonl "
             "--config.data.preferences.eval_files={{inputs}}/{0}.jsonl")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """What the bad inputs point at: a regular file, a corrupt TFRecord, broken config files."""
    folder = tmp_path_factory.mktemp("inputs")
    (folder / "afile").write_text("a file, not a directory\n")
    (folder / "garbage.tfrecord").write_bytes(b"these bytes are not a TFRecord\x00\x01\x02" * 8)
    derived = ("import sys\nsys.path.insert(0, 'configs')\nimport {module}\n\n\n"
               "def get_config(arg=None):\n    config = {module}.get_config('tiny')\n{body}"
               "    return config\n")
    (folder / "typo.py").write_text(derived.format(
        module="lm_stdlib", body="    config.train.learnig_rate = 0.1\n"))
    (folder / "wrong_type.py").write_text(derived.format(
        module="lm_stdlib", body="    config.train.steps = '100'\n"))
    (folder / "tfrecords.py").write_text(derived.format(module="digits", body=(
        "    config.data.tfds.update(name='', eval_split='validation')  # digits' own: unread\n"
        f"    config.data.tfrecords.files = {str(folder / 'garbage.tfrecord')!r}\n"
        f"    config.data.tfrecords.eval_files = {str(folder / 'garbage.tfrecord')!r}\n"
        "    config.data.tfrecords.features = {'image': 'float32[8,8,1]', 'label': 'int64'}\n")))
    (folder / "flat_data_key.py").write_text(derived.format(
        module="lm_stdlib", body="    config.data.name = 'stdlib_bytes/ctx64'\n"))
    (folder / "data_switch.py").write_text(derived.format(
        module="lm_stdlib", body="    config.data.instructions = True\n"))
    (folder / "two_kinds.py").write_text(derived.format(
        module="lm_stdlib", body="    config.data.text.files = 'docs/*.txt'\n"))
    (folder / "unused_part.py").write_text(derived.format(
        module="lm_stdlib", body="    config.data.instructions.prompt_field = 'question'\n"))
    (folder / "syntax_error.py").write_text("def get_config(:\n")
    (folder / "corrupt_preset").mkdir()
    (folder / "corrupt_preset" / "config.json").write_text("{not json")
    (folder / "doc.txt").write_text("def f():\n    return 1\n" * 40)
    (folder / "docs.jsonl").write_text('{"body": "no text key here"}\n')
    (folder / "pairs.jsonl").write_text('{"prompt": "a", "response": "b"}\n'
                                        '{"prompt": "c", "answer": "d"}\n')
    (folder / "prefs_missing.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
                                                '{"prompt": "a", "chosen": "b"}\n')
    (folder / "prefs_same.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "b"}\n')
    (folder / "long.jsonl").write_text('{"prompt": "%s", "response": "b"}\n' % ("x" * 100))
    # GRPO: llama_stdlib:tiny on the jax engine completing sums, scored by rewards.py.
    (folder / "sums.jsonl").write_text("".join('{"prompt": "%d+%d=", "answer": "%d"}\n' % (a, a, 2 * a)
                                               for a in range(8)))
    (folder / "rewards.py").write_text(
        "def count(prompts, completions, **fields):\n    return [len(c) for c in completions]\n\n\n"
        "def too_few(prompts, completions, **fields):\n    return [1.0]\n\n\n"
        "def not_finite(prompts, completions, **fields):\n"
        "    return [float('nan')] * len(completions)\n")
    (folder / "grpo.py").write_text(derived.format(module="llama_stdlib", body=(
        "    config.engine = 'jax'\n"
        "    config.data.tfds.name, config.data.preprocess = '', ''\n"
        f"    config.data.prompts.files = {str(folder / 'sums.jsonl')!r}\n"
        f"    config.grpo.update(num_generations=2, max_completion_length=4, rewards=("
        f"{str(folder / 'rewards.py') + ':count'!r},))\n"
        "    config.train.update(batch_size=4, steps=2, eval_every=2, steps_per_execution=0)\n"
        "    config.checkpoint.every_steps, config.log.every_steps = 2, 2\n")))
    (folder / "long_response.jsonl").write_text('{"prompt": "a", "response": "b"}\n'
                                                '{"prompt": "a", "response": "%s"}\n' % ("y" * 100))
    return folder


# (config, overrides, fragments of the error line). Overrides may name {inputs} and
# {data_dir}; a later --workdir replaces the test's own. Config mistakes end before
# TensorFlow loads; the rest need TensorFlow, and share one start of it where they can.
CASES = [
    # Config keys.
    pytest.param(LM_TINY, ["--config.train.stesp=5"], ["--config.train.stesp", "'steps'"],
                 id="key-typo-in-flag"),
    pytest.param(LM_TINY, ["--config.trian.steps=5"], ["--config.trian.steps", "'train'"],
                 id="section-typo-in-flag"),
    pytest.param(LM_TINY, ["--config.model.widht=8"], ["model.widht", "'width'"],
                 id="model-key-typo-in-flag"),
    pytest.param(LM_TINY, ["--config.model.image_shape=8"],
                 ["unknown config key 'model.image_shape' for builder 'gpt'"],
                 id="key-of-another-model"),
    pytest.param("{inputs}/typo.py", [], ["train.learnig_rate", "'learning_rate'"],
                 id="key-typo-in-config-file"),
    # The data section in parts: a flat key of before names its new place; a part is read
    # or refused.
    pytest.param(LM_TINY, ["--config.data.text_files=x.txt"],
                 ["--config.data.text_files: data.text_files moved to data.text.files",
                  "instruction data: data.instructions.files"], id="flat-data-key-in-flag"),
    pytest.param(LM_TINY, ["--config.data.preferences=true"],
                 ["data.preferences is a part of the data section now, not a switch",
                  "set data.preferences.files"], id="data-switch-in-flag"),
    pytest.param("{inputs}/flat_data_key.py", [], ["data.name moved to data.tfds.name"],
                 id="flat-data-key-in-config-file"),
    pytest.param("{inputs}/data_switch.py", [],
                 ["data.instructions is a part of the data section now", "data.instructions.files"],
                 id="data-switch-in-config-file"),
    pytest.param("{inputs}/two_kinds.py", [],
                 ["names several kinds of data (data.tfds.name, data.text.files); set one"],
                 id="two-kinds-of-data"),
    pytest.param("{inputs}/unused_part.py", [],
                 ["data.instructions.prompt_field is set, but this run reads data.tfds",
                  "set data.instructions.files to read that kind of data instead"],
                 id="a-part-the-run-does-not-read"),
    # Value types.
    pytest.param(LM_TINY, ["--config.train.steps=abc"],
                 ["--config.train.steps=abc is not an int", "set train.steps to an int"],
                 id="int-flag-not-a-number"),
    pytest.param(LM_TINY, ["--config.train.jit_compile=maybe"],
                 ["--config.train.jit_compile=maybe", "set train.jit_compile to true or false"],
                 id="bool-flag-not-a-bool"),
    pytest.param("{inputs}/wrong_type.py", [],
                 ["steps takes an int, not the str", "wrong_type.py, line 8"],
                 id="wrong-type-in-config-file"),
    # Ranges and choices.
    pytest.param(LM_TINY, ["--config.train.steps=0"], ["train.steps=0", "set train.steps to 1 or more"],
                 id="steps-zero"),
    pytest.param(LM_TINY, ["--config.train.batch_size=0"], ["train.batch_size=0", "1 or more"],
                 id="batch-size-zero"),
    pytest.param(LM_TINY, ["--config.train.learning_rate=-0.1"],
                 ["train.learning_rate=-0.1", "0 or more"], id="negative-learning-rate"),
    pytest.param(LM_TINY, ["--config.checkpoint.keep=0"], ["checkpoint.keep=0", "1 or more"],
                 id="keep-no-checkpoint"),
    pytest.param(LM_TINY, ["--config.log.every_steps=0"], ["log.every_steps=0", "1 or more"],
                 id="log-every-zero-steps"),
    pytest.param(LM_TINY, ["--config.train.eval_every=15"],
                 ["train.eval_every=15", "multiple of log.every_steps=10"], id="eval-off-the-log-grid"),
    pytest.param(LM_TINY, ["--config.engine=torch"], ["engine='torch'", "'jax'", "'tf'"],
                 id="unknown-engine"),
    pytest.param(LM_TINY, ["--config.cluster.strategy=mirorred"],
                 ["cluster.strategy='mirorred'", "'mirrored'"], id="unknown-strategy"),
    pytest.param(LM_TINY, ["--config.train.precision=bfloat16"],
                 ["train.precision='bfloat16'", "'mixed_bfloat16'"], id="unknown-precision"),
    pytest.param(LM_TINY, ["--config.mesh.model=0"], ["'model': 0", "give each axis a positive size"],
                 id="mesh-axis-zero"),
    pytest.param(DIGITS_TINY, ["--config.mesh.slices=2"],
                 ["mesh.slices=2 needs the jax engine", "--config.engine=jax", "TPUStrategy"],
                 id="slices-on-the-tf-engine"),
    pytest.param(DIGITS_TINY, ["--config.engine=jax", "--config.mesh.slices=2",
                               "--config.layout.extra_rules=((r'dense0/kernel', (None, 'slices')),)"],
                 ["layout rule 'dense0/kernel'", "never split across slices", "'fsdp' or 'model'"],
                 id="rule-names-the-slice-axis"),
    pytest.param(LM_TINY, ["--config.log.profile_steps=(12, 11)"],
                 ["log.profile_steps=(12, 11)", "1 <= first <= last"], id="profile-steps-backwards"),
    pytest.param(DIGITS_TINY, ["--config.train.optimizer=adamx"],
                 ["train.optimizer='adamx'", "'adamax'"], id="unknown-optimizer"),
    # Devices.
    pytest.param(DIGITS_TINY, ["--config.engine=jax", "--config.cluster.virtual_devices=2",
                               "--config.mesh.model=3"],
                 ["'model': 3", "does not fit 2 devices", "use mesh.model=1 or 2"],
                 id="mesh-does-not-fit-the-devices"),
    pytest.param(DIGITS_TINY, ["--config.engine=jax", "--config.cluster.virtual_devices=4",
                               "--config.mesh.slices=3"],
                 ["mesh.slices=3 does not divide the 4 devices"], id="slices-do-not-divide-the-devices"),
    pytest.param(LM_TINY, ["--config.cluster.virtual_devices=4", "--config.train.batch_size=30", DATA],
                 ["batch_size=30", "4 replicas", "multiple of 4"], id="batch-across-replicas"),
    pytest.param(DIGITS_TINY, ["--config.cluster.strategy=tpu", "--config.cluster.tpu=no-such-tpu"],
                 ["no TPU reachable as cluster.tpu='no-such-tpu'", "cluster.strategy=auto"],
                 id="unreachable-tpu"),
    # Data.
    pytest.param(DIGITS_TINY, ["--config.data.tfds.name=mnist",
                               "--config.data.data_dir={inputs}/no-such-dir"],
                 ["'mnist' is not prepared", "no such directory", "set data.data_dir"],
                 id="missing-data-dir"),
    pytest.param(LM_TINY, ["--config.data.tfds.name=stdlib_byte", DATA],
                 ["unknown dataset 'stdlib_byte'", "stdlib_bytes"], id="unknown-dataset"),
    pytest.param(LM_TINY, ["--config.data.tfds.name=stdlib_bytes/ctx999", DATA],
                 ["'stdlib_bytes' has no variant 'ctx999'", "'stdlib_bytes/ctx128'"],
                 id="unknown-dataset-variant"),
    pytest.param(LM_TINY, ["--config.data.tfds.eval_split=valdation", DATA],
                 ["data.tfds.eval_split='valdation'", "'validation'"], id="unknown-split"),
    pytest.param("{inputs}/tfrecords.py", ["--config.data.tfrecords.eval_files={inputs}/none-*.tfrecord"],
                 ["data.tfrecords.eval_files=", "matches no file"], id="glob-matches-nothing"),
    pytest.param("{inputs}/tfrecords.py", [],
                 ["garbage.tfrecord is not a readable TFRecord file",
                  "leave it out of data.tfrecords.files"],
                 id="corrupt-tfrecord"),
    # Text sources.
    pytest.param(LM_TINY, ["--config.data.tfds.name=", "--config.data.text.files={inputs}/doc.txt",
                           "--config.data.text.eval_files={inputs}/none-*.txt", DATA],
                 ["data.text.eval_files='", "none-*.txt' matches no file", ".txt or .jsonl"],
                 id="text-glob-matches-nothing"),
    pytest.param(LM_TINY, ["--config.data.tfds.name=", "--config.data.text.files={inputs}/docs.jsonl",
                           "--config.data.text.eval_files={inputs}/docs.jsonl",
                           "--config.data.text.field=text", DATA],
                 ["docs.jsonl:1 has no text under data.text.field='text'", "['body']"],
                 id="jsonl-without-the-text-field"),
    pytest.param(LM_TINY, ["--config.data.tfds.name=", "--config.data.instructions.files={inputs}/pairs.jsonl",
                           "--config.data.instructions.eval_files={inputs}/pairs.jsonl", DATA],
                 ["pairs.jsonl:2 has no text under data.instructions.response_field='response'",
                  "set data.instructions.response_field to the key of the response",
                  "['answer', 'prompt']"],
                 id="instruction-without-its-response"),
    pytest.param(LM_TINY, ["--config.data.tfds.name=", "--config.data.instructions.files={inputs}/long.jsonl",
                           "--config.data.instructions.eval_files={inputs}/long.jsonl", DATA],
                 ["long.jsonl:1 has a prompt of 100 tokens, longer than data.tokens.context_length=64",
                  "raise data.tokens.context_length", "to at least 100, or shorten that prompt"],
                 id="instruction-prompt-longer-than-the-context"),
    pytest.param(LM_TINY, ["--config.data.tfds.name=",
                           "--config.data.instructions.files={inputs}/long_response.jsonl",
                           "--config.data.instructions.eval_files={inputs}/long_response.jsonl", DATA],
                 ["long_response.jsonl:2 is an example of 102 tokens, longer than a row of "
                  "data.tokens.context_length + 1 = 65 tokens", "set data.instructions.truncate=True"],
                 id="instruction-example-longer-than-a-row"),
    # Preference pairs (DPO).
    pytest.param(LLAMA_TINY, [*DPO_PAIRS.format("prefs_missing").split(), DATA],
                 ["prefs_missing.jsonl:2 has no text under data.preferences.rejected_field='rejected'",
                  "['chosen', 'prompt']"], id="preference-pair-without-rejected"),
    pytest.param(LLAMA_TINY, [*DPO_PAIRS.format("prefs_same").split(), DATA],
                 ["prefs_same.jsonl:1 has the same text under data.preferences.chosen_field='chosen' "
                  "and data.preferences.rejected_field='rejected'", "fix the pair or drop the line"],
                 id="preference-pair-chosen-equals-rejected"),
    pytest.param(LLAMA_TINY, [*DPO_PAIRS.format("prefs_same").split(), "--config.dpo.beta=-0.5",
                              DATA], ["dpo.beta=-0.5 must be a number above 0"], id="dpo-beta-not-positive"),
    pytest.param(LLAMA_TINY, [*DPO_PAIRS.format("prefs_same").split(), "--config.train.dpo_beta=0.2",
                              DATA], ["--config.train.dpo_beta moved to --config.dpo.beta"],
                 id="dpo-beta-of-before"),
    pytest.param(DIGITS_TINY, ["--config.data.tfds.name=", "--config.data.tfds.eval_split=validation",
                               "--config.data.preprocess=",
                               "--config.data.preferences.files={inputs}/prefs_same.jsonl",
                               "--config.data.preferences.eval_files={inputs}/prefs_same.jsonl", DATA],
                 ["DPO (data.preferences) trains a language model", "keras_hub:LlamaCausalLM"],
                 id="dpo-on-a-model-that-is-not-a-language-model"),
    # GRPO (data.prompts): what the config tells before an engine starts (the rest below).
    pytest.param("{inputs}/grpo.py", ["--config.grpo.num_generations=1"],
                 ["grpo.num_generations=1", "a group needs 2 or more"], id="grpo-group-of-one"),
    pytest.param("{inputs}/grpo.py", ["--config.train.batch_size=6", "--config.grpo.num_generations=4"],
                 ["train.batch_size=6 is not a multiple of grpo.num_generations=4", "whole groups"],
                 id="grpo-batch-of-part-groups"),
    pytest.param("{inputs}/grpo.py", ["--config.grpo.num_iterations=3"],
                 ["checkpoint.every_steps=2 must be a multiple of grpo.num_iterations=3"],
                 id="grpo-iterations-off-the-checkpoint-grid"),
    pytest.param(LM_TINY, ["--config.grpo.beta=0.1", DATA],
                 ["grpo.beta is set, but this run reads data.tfds", "set data.prompts.files"],
                 id="grpo-setting-on-other-data"),
    pytest.param("{inputs}/grpo.py", ["--config.grpo.max_completion_length=100000"],
                 ["grpo.max_completion_length=100000 leaves no room for a prompt in "
                  "model.context_length=64 tokens", "set it below 64"], id="grpo-completion-fills-the-context"),
    pytest.param(LLAMA_TINY, ["--config.mesh.context=3"],
                 ["mesh.context=3 does not divide the sequence's 64 tokens", "pick a divisor"],
                 id="context-axis-that-does-not-divide-the-sequence"),
    pytest.param(DIGITS_TINY, ["--config.mesh.context=2"],
                 ["mesh.context=2 splits a language model's sequences", "no model.context_length"],
                 id="context-axis-on-an-image-model"),
    pytest.param("{inputs}/grpo.py", ["--config.mesh.context=2"],
                 ["mesh.context=2 splits the sequences of a batch", "GRPO does not train on its rows",
                  "drop mesh.context"], id="context-axis-under-grpo"),
    pytest.param(LM_TINY, ["--config.train.loss_chunks=3", DATA],
                 ["train.loss_chunks=3 does not divide the sequence's 64 tokens", "pick a divisor"],
                 id="loss-chunks-that-do-not-divide-the-sequence"),
    pytest.param("{inputs}/grpo.py", ["--config.engine=tf"],
                 ["GRPO (data.prompts) samples inside the run on the jax engine", "engine='jax'"],
                 id="grpo-on-the-tf-engine"),
    pytest.param(LM_TINY, ["--config.data.text.field=text", DATA],
                 ["'stdlib_bytes/ctx64' has no text feature data.text.field='text'"],
                 id="tfds-without-the-text-feature"),
    pytest.param(LM_TINY, ["--config.data.tfds.name=", "--config.data.text.files={inputs}/doc.txt",
                           "--config.data.text.eval_files={inputs}/doc.txt",
                           "--config.data.tokens.tokenizer=LlamaTokeniser", DATA],
                 ["data.tokens.tokenizer='LlamaTokeniser'", "'LlamaTokenizer'"], id="unknown-tokenizer"),
    pytest.param(LM_TINY, ["--config.data.tfds.name=", "--config.data.text.files={inputs}/doc.txt",
                           "--config.data.text.eval_files={inputs}/doc.txt",
                           "--config.model.vocab_size=200", DATA],
                 ["has 256 tokens but the model's embedding has 200", "vocab_size) to 256"],
                 id="vocabulary-does-not-match-the-model"),
    # LoRA.
    pytest.param(LLAMA_TINY, ["--config.model.lora_rank=4", "--config.model.lora_targets=q_proj,qkv_proj"],
                 ["model.lora_targets has 'qkv_proj', which is not a projection of the llama family",
                  "choose from q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or 'all-linear'"],
                 id="lora-target-unknown-to-the-family"),
    pytest.param(LLAMA_TINY, ["--config.model.lora_rank=4", "--config.model.lora_alpha=0"],
                 ["model.lora_alpha=0 must be a number above 0", "PEFT's default is 8"],
                 id="lora-alpha-not-positive"),
    pytest.param(LM_TINY, ["--config.model.lora_rank=4", "--config.model.lora_targets=gate_proj"],
                 ["model.lora_targets has 'gate_proj', which is not a projection of the gpt family",
                  "choose from q_proj, k_proj, v_proj, o_proj, up_proj, down_proj"],
                 id="lora-target-the-gpt-lacks"),
    pytest.param(LLAMA_TINY, ["--config.model.lora_rank=4",
                              "--config.model.lora_target_parameters=mlp.experts.gate_up_proj"],
                 ["model.lora_target_parameters has 'mlp.experts.gate_up_proj'",
                  "the llama family names no stacked expert weights"], id="lora-experts-of-a-dense-family"),
    # A quantized base under LoRA (model.quantize).
    pytest.param(LLAMA_TINY, ["--config.model.lora_rank=4", "--config.model.quantize=gptq"],
                 ["model.quantize='gptq'", "GPTQ kernels take no LoRA", "choose 'int8' or 'int4'"],
                 id="quantize-gptq-under-lora"),
    pytest.param(LLAMA_TINY, ["--config.model.lora_rank=4", "--config.model.quantize=float8"],
                 ["model.quantize='float8'", "not a frozen base", "choose 'int8' or 'int4'"],
                 id="quantize-float8-under-lora"),
    pytest.param(LLAMA_TINY, ["--config.model.quantize=int8"],
                 ["model.quantize='int8' freezes a quantized base for LoRA", "set model.lora_rank",
                  "quantize the exported model for serving"], id="quantize-without-lora"),
    pytest.param(LLAMA_TINY, ["--config.model.lora_rank=4", "--config.model.quantize=int4"],
                 ["model.quantize='int4' runs on the jax engine", "--config.engine=jax"],
                 id="quantize-on-the-tf-engine"),
    pytest.param(LLAMA_TINY, ["--config.engine=jax", "--config.model.lora_rank=4",
                              "--config.model.quantize=int8", "--config.model.quantize_block_size=64"],
                 ["model.quantize_block_size=64", "int8 has one scale per output feature",
                  "model.quantize='int4'"], id="quantize-int8-in-groups"),
    pytest.param(LLAMA_TINY, ["--config.layout.split_logits=True"],
                 ["layout.split_logits", "fsdp=1, model=1", "set mesh.fsdp above 1"],
                 id="split-logits-without-fsdp"),
    pytest.param(LLAMA_TINY, ["--config.layout.sequence_parallel=True"],
                 ["layout.sequence_parallel", "mesh.model=1", "set mesh.model above 1"],
                 id="sequence-parallel-without-a-model-axis"),
    pytest.param(LLAMA_TINY, ["--config.engine=jax", "--config.mesh.data=1", "--config.mesh.model=2",
                              "--config.mesh.context=2", "--config.model.context_length=38",
                              "--config.layout.sequence_parallel=True"],
                 ["layout.sequence_parallel", "38 tokens", "context x model = 4"],
                 id="sequence-parallel-that-does-not-divide-the-sequence"),
    pytest.param(LM_TINY, ["--config.train.remat=blocks"],
                 ["train.remat='blocks'", "model 'gpt' has none", "train.remat='activations'"],
                 id="remat-blocks-without-blocks"),
    pytest.param(LLAMA_TINY, ["--config.engine=jax", "--config.model.lora_rank=4",
                              "--config.model.quantize=int4", "--config.model.quantize_block_size=0.5"],
                 ["model.quantize_block_size", "-1 for one scale per output feature"],
                 id="quantize-block-size-not-a-count"),
    # Presets.
    pytest.param(LLAMA_TINY, ["--config.model.preset={inputs}/no-such-preset"],
                 ["model.preset=", "no-such-preset' does not exist", "save_pretrained wrote"],
                 id="preset-path-does-not-exist"),
    pytest.param(LLAMA_TINY, ["--config.model.preset=llama2_7b_enn"],
                 ["model.preset='llama2_7b_enn' is neither a folder nor one of keras-hub's",
                  "'llama2_7b_en'"], id="preset-name-typo"),
    pytest.param(LLAMA_TINY, ["--config.model.preset={inputs}/corrupt_preset"],
                 ["corrupt_preset", "config.json is not JSON", "write the preset again"],
                 id="preset-config-not-json"),
    # The command line and the workdir.
    pytest.param("configs/nope.py", [], ["configs/nope.py"], id="missing-config-file"),
    pytest.param("configs/digits.py:huge", [], ["unknown variant 'huge'", "'tiny'"],
                 id="unknown-config-variant"),
    pytest.param("{inputs}/syntax_error.py", [], ["syntax_error.py", "SyntaxError"],
                 id="config-file-does-not-parse"),
    pytest.param(LM_TINY, ["--workdir="], ["--workdir=DIR are required"], id="empty-workdir"),
    pytest.param(LM_TINY, ["extra"], ["unexpected arguments ['extra']"], id="stray-argument"),
    pytest.param(DIGITS_TINY, ["--workdir={inputs}/afile/run"],
                 ["cannot write to --workdir=", "afile/run", "choose a directory"],
                 id="workdir-under-a-file"),
    pytest.param(DIGITS_TINY, ["--workdir=nope://bucket/run"],
                 ["cannot write to --workdir=nope://bucket/run", "scheme 'nope' not implemented"],
                 id="workdir-on-an-unknown-filesystem"),
]


# Overrides that pick the engine or fix the devices: such a case needs a process of its own.
OWN_PROCESS = ("--config.engine=", "--config.cluster.")


@pytest.fixture(scope="module")
def filled(inputs, data_dir):
    """`filled(config, overrides)`: the case's config and overrides with {inputs} and {data_dir}."""
    def fill(config, overrides):
        return config.format(inputs=inputs, data_dir=data_dir), [
            o.format(inputs=inputs, data_dir=data_dir) for o in overrides]
    return fill


@pytest.fixture(scope="module")
def refused_together(filled, tmp_path_factory):
    """The cases on the tf engine's default devices, refused by one process of
    tests/helpers/cli_batch.py (one start of TensorFlow instead of one per case)."""
    calls = {}
    for case in CASES:
        config, overrides = filled(*case.values[:2])
        if not any(o.startswith(OWN_PROCESS) for o in overrides):
            calls[case.id] = train_args(config, tmp_path_factory.mktemp("run"), *overrides)
    return run_in_one_process("tpu_keras.train", calls)


@pytest.mark.parametrize("config, overrides, fragments", CASES)
def test_bad_input_is_one_line_that_says_what_to_change(request, tmp_path, filled, refused_together,
                                                        config, overrides, fragments):
    result = refused_together.get(request.node.callspec.id)
    if result is None:  # a case that picks the engine or fixes the devices
        config, overrides = filled(config, overrides)
        result = train(config, tmp_path / "run", *overrides, check=False)
    assert result.returncode == 2, (result.stdout + (result.stderr or ""))[-3000:]
    assert_one_line_error(result, *fragments)


# GRPO's mistakes found once the run has its model and data: (overrides, fragments), in one
# process on the jax engine.
GRPO_CASES = {
    "reward-cannot-be-imported": (["--config.grpo.rewards=('no_such_rewards:score',)"],
                                  ["grpo.rewards ('no_such_rewards:score') has 'no_such_rewards', which cannot be imported"]),
    "reward-returns-too-few": (["--config.grpo.rewards=('{inputs}/rewards.py:too_few',)"],
                               ["reward function", "too_few returned 1 value(s) for 4 completions"]),
    "reward-not-finite": (["--config.grpo.rewards=('{inputs}/rewards.py:not_finite',)"],
                          ["reward function", "not_finite returned", "nan"]),
    "stop-of-two-tokens": (["--config.grpo.stop=ab"],
                           ["grpo.stop='ab' is 2 tokens of bytes", "the text of one token"]),
    "prompt-longer-than-the-context-leaves": (  # a context of 64 tokens; '0+0=' is 4
        ["--config.grpo.max_completion_length=61"],
        ["the prompt of", "sums.jsonl line 1 is 4 tokens, longer than the 3 the context leaves "
         "beside grpo.max_completion_length=61"]),
}


@pytest.mark.slow  # over 15 s: the full suite's (the fast tier keeps within 5 minutes)
def test_grpo_bad_input_is_one_line_that_says_what_to_change(filled, tmp_path):
    calls = {}
    for name, (overrides, _) in GRPO_CASES.items():
        config, overrides = filled("{inputs}/grpo.py", overrides)
        calls[name] = train_args(config, tmp_path / name, *overrides)
    refused = run_in_one_process("tpu_keras.train", calls)
    for name, (_, fragments) in GRPO_CASES.items():
        result = refused[name]
        assert result.returncode == 2, (name, (result.stdout + result.stderr)[-3000:])
        assert_one_line_error(result, *fragments)


@pytest.mark.parametrize("command, fragment", [
    (["tpu_keras.info", "--bogus"], "Unknown command line flag 'bogus'"),
    (["tpu_keras.plan"], "give --config=configs/<name>.py and --tpu=<slice>"),
    (["tpu_keras.layout", "--config=nope.py"], "cannot load --config=nope.py"),
    (["tpu_keras.train", "--config=nope.py", "--workdir=/tmp/unused"], "cannot load --config=nope.py"),
    (["tpu_keras.launch", "--hosts=0", "--", "true"], "--hosts must be >= 1"),
    (["tpu_keras.data_service", "--port=abc"], "port"),
], ids=["info", "plan", "layout", "train", "launch", "data-service"])
def test_every_command_fails_the_same_way(command, fragment):
    result = run_command([sys.executable, "-m", *command], check=False)
    assert result.returncode == 2, result.stdout[-2000:]
    assert_one_line_error(result, fragment)


@pytest.mark.parametrize("override", ["--config.train.steps=0", "--config.train.steps=abc"])
def test_verbose_shows_the_traceback_too(tmp_path, override):
    result = train(LM_TINY, tmp_path, override, "--verbose", check=False)
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stdout
    last = result.stdout.rstrip().splitlines()[-1]
    assert last.startswith("error: ") and "train.steps" in last, result.stdout[-3000:]


def test_resuming_a_different_model_on_the_same_workdir(tmp_path, data_dir, tiny_run):
    # The tiny gpt (width 32, depth 1) restored into a wider model, and into a deeper one:
    # the first weight that differs, by name; both in one process.
    changes = {"wider": ["--config.model.width=64"], "deeper": ["--config.model.depth=2"]}
    for name in changes:
        shutil.copytree(tiny_run[0] / "checkpoints", tmp_path / name / "checkpoints")
    results = run_in_one_process("tpu_keras.train", {
        name: train_args(LM_TINY, tmp_path / name, f"--config.data.data_dir={data_dir}", *change)
        for name, change in changes.items()})
    assert_one_line_error(results["wider"], "does not fit this model: weight 'token_embedding/embeddings' "
                          "is [256, 32] in the checkpoint and [256, 64] in this model", "use a new --workdir")
    assert_one_line_error(results["deeper"], "does not fit this model: weight "
                          "'block1_attention_norm/gamma' [32] of this model is not in the checkpoint",
                          "use a new --workdir")


def test_every_flat_data_key_of_before_names_its_new_place():
    """In a config file or on the command line (the cases above), and here for every key."""
    from tpu_keras import config as config_lib, data_section
    for key, place in data_section.MOVED.items():
        config = config_lib.defaults()
        config.data[key] = config_lib.defaults().data[place.split(".")[0]][place.split(".")[1]]
        with pytest.raises(UserError, match=rf"^data\.{key} moved to data\.{re.escape(place)}\b"):
            config_lib.check(config)


def test_a_run_written_before_the_parts_reads_in_parts(tmp_path):
    """A workdir's config.json from before the parts (evaluate, export and generate read it)."""
    from tpu_keras import config as config_lib, data_section
    flat = {"name": "", "instructions": True, "text_files": "t/*.jsonl", "eval_text_files": "v/*.jsonl",
            "prompt_field": "q", "truncate": True, "tokenizer": "preset", "context_length": 128,
            "token_counts": "/w/token_counts", "data_dir": "/d"}
    parts = data_section.migrated(flat)
    assert parts == {"data_dir": "/d", "tfds": {"name": ""},
                     "instructions": {"files": "t/*.jsonl", "eval_files": "v/*.jsonl",
                                      "prompt_field": "q", "truncate": True},
                     "tokens": {"tokenizer": "preset", "context_length": 128, "counts": "/w/token_counts"}}
    config = config_lib.defaults()
    config.data.update(parts)
    config_lib.check(config)
    assert data_section.kind(config.data) == "instructions"
    pairs = data_section.migrated({"preferences": True, "text_files": "p/*.jsonl", "prompt_field": "q"})
    assert pairs == {"preferences": {"files": "p/*.jsonl", "prompt_field": "q"}}
    (tmp_path / "config.json").write_text(json.dumps({"data": flat}))  # as such a run wrote it
    read = config_lib.read_run_config(str(tmp_path))
    assert read.data.instructions.files == "t/*.jsonl" and read.data.tokens.counts == "/w/token_counts"
    assert data_section.kind(read.data) == "instructions"


# Every shipped config and variant, with the part of the data section it reads.
SHIPPED = {"digits": ("tfds", ["", "mlp", "cnn", "resnet", "tiny"]),
           "lm_stdlib": ("tfds", ["", "tiny", "wide", "1b"]),
           "llama_stdlib": ("tfds", ["", "tiny", "lora"]), "llama_stdlib:spm": ("text", [""]),
           "llama_stdlib:spm_tiny": ("text", [""]),
           "instruct_stdlib": ("instructions", ["", "tiny"]),
           "preference_stdlib": ("preferences", ["", "tiny"]),
           "grpo_stdlib": ("prompts", ["", "tiny"]), "grpo_stdlib:sft": ("instructions", [""]),
           "finetune": ("", ["", "full"])}  # its files come from the command line


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_config_passes_its_checks_and_reads_one_part(name):
    from tpu_keras import cli, config as config_lib, data_section
    kind, variants = SHIPPED[name]
    module, _, fixed = name.partition(":")
    for variant in variants:
        config = cli.load_config(f"configs/{module}.py" + (f":{fixed or variant}" if fixed or variant else ""))
        config_lib.check(config)
        assert data_section.kind(config.data) == kind, (name, variant)
