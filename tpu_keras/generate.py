"""Sample text from a language model: `python -m tpu_keras.generate --workdir=DIR --prompt="def "`.

Loads the newest checkpoint of the run in DIR (the `gpt` builder or a
keras-hub causal LM, on the engine it trained on) with the run's own
tokenizer, or with --preset=PATH any keras-hub causal LM preset folder
(what `save_to_preset` writes) with its tokenizer, and prints the prompt
continued up to --max_length tokens or the end token. With the same --seed
the text is the same; --temperature=0 picks the likeliest token each time,
which for a keras-hub model is exactly `CausalLM.generate` with a greedy
sampler.

--prompts_file=FILE takes a batch instead: JSON lines, each a string or an
object with a "prompt" field; each prints as one JSON line, the object with
"text" (the prompt and its continuation) added.
"""

# Imported inside functions: Keras and TensorFlow (the engine must be selected first:
# engine.select); NumPy (start-up time: not every caller needs it).
import json

from absl import flags, logging

from tpu_keras import cli
from tpu_keras import config as config_lib
from tpu_keras.cluster import engine
from tpu_keras.errors import UserError
from tpu_keras.tools import generation

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder (its config.json and checkpoints).")
_PRESET = flags.DEFINE_string("preset", None, "Instead of --workdir: a keras-hub causal LM preset "
                              "folder with its tokenizer.")
_ENGINE = flags.DEFINE_enum("engine", "tf", ["tf", "jax"], "The engine a --preset runs on (a "
                            "--workdir runs on its run's).")
_PROMPT = flags.DEFINE_string("prompt", "def ", "The text to continue.")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, "JSON lines of prompts (strings, or "
                                    "objects with a \"prompt\" field); one JSON line out for each.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Prompts of --prompts_file sampled together.")
_MAX_LENGTH = flags.DEFINE_integer("max_length", 0, "Tokens in all, prompt included; 0: the "
                                   "model's context length.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Softmax temperature; 0: greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the K likeliest tokens; 0: among all.")
_SEED = flags.DEFINE_integer("seed", 0, "The sampler's seed: the same seed, the same text.")


def main(argv):
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {argv[1:]}")
    if bool(_WORKDIR.value) == bool(_PRESET.value):
        raise UserError("give either --workdir=DIR, the folder of a language-model run, or "
                        "--preset=PATH, a keras-hub causal LM preset folder")
    if _TEMPERATURE.value < 0 or _TOP_K.value < 0 or _BATCH_SIZE.value < 1:
        raise UserError("--temperature and --top_k must be 0 or more, --batch_size 1 or more")
    logging.set_verbosity(logging.WARNING)
    config = config_lib.read_run_config(_WORKDIR.value) if _WORKDIR.value else None
    engine.select(config.engine if config else _ENGINE.value)  # before TensorFlow brings Keras
    records = _read_prompts(_PROMPTS_FILE.value) if _PROMPTS_FILE.value else None
    prompts = [record["prompt"] for record in records] if records else [_PROMPT.value]
    if not all(prompts):
        raise UserError("a prompt is empty; give the text to continue, such as --prompt='def '")
    from tpu_keras.models import hub
    hub.import_keras_hub()  # its samplers serve every model: a one-line error without the extra
    generator = (generation.from_run(_WORKDIR.value, config) if config
                 else generation.from_preset(_PRESET.value))
    max_length = _MAX_LENGTH.value or generator.context
    for number, prompt in enumerate(prompts, 1):
        _check_length(generator, prompt, max_length, number if records else 0)
    sampler = generation.make_sampler(_TEMPERATURE.value, _TOP_K.value, _SEED.value, generator.vocabulary)
    if records is None:
        print(generator.generate(prompts, max_length, sampler)[0])
    else:
        for start in range(0, len(prompts), _BATCH_SIZE.value):
            batch = prompts[start:start + _BATCH_SIZE.value]
            for record, text in zip(records[start:], generator.generate(batch, max_length, sampler)):
                print(json.dumps({**record, "text": text}, ensure_ascii=False), flush=True)
    cli.exit_at_once(0)


def _read_prompts(path: str) -> list:
    """The records of a JSON-lines prompts file (blank lines skipped), or a one-line error."""
    import tensorflow as tf  # tf.io.gfile: the file may be on gs://
    if not tf.io.gfile.exists(path):
        raise UserError(f"--prompts_file={path!r} does not exist")
    from tpu_keras.data import json_lines
    records = []
    for number, record in json_lines.records(path):
        if isinstance(record, str):
            record = {"prompt": record}
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UserError(f"line {number} of --prompts_file={path!r} is not a JSON string or "
                            "an object with a \"prompt\" string; write one such per line")
        records.append(record)
    if not records:
        raise UserError(f"--prompts_file={path!r} holds no prompts; write one JSON line per prompt")
    return records


def _check_length(generator, prompt: str, max_length: int, number: int) -> None:
    which = f"prompt {number} of --prompts_file" if number else "the prompt"
    tokens = generator.count(prompt)
    if tokens > generator.context:
        raise UserError(f"{which} is {tokens} tokens, longer than the model's context of "
                        f"{generator.context}; shorten it")
    if not tokens < max_length <= generator.context:
        raise UserError(f"--max_length={max_length} must be above the {tokens} tokens of {which} "
                        f"and at most the model's context length, {generator.context}")


if __name__ == "__main__":
    cli.start(main)
