"""Sample text from a language-model run: `python -m tpu_keras.generate --workdir=DIR --prompt="def "`.

Loads the newest checkpoint of the run in DIR (the `gpt` builder or a
keras-hub causal LM, on the engine it trained on) and prints the prompt
continued to --max_length bytes. With the same --seed the text is the same;
--temperature=0 picks the likeliest byte each time.
"""

from absl import flags, logging

from tpu_keras import cli
from tpu_keras.errors import UserError

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder (its config.json and checkpoints).")
_PROMPT = flags.DEFINE_string("prompt", "def ", "The text to continue.")
_MAX_LENGTH = flags.DEFINE_integer("max_length", 0, "Bytes in all, prompt included; 0: the model's "
                                   "context length.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Softmax temperature; 0: greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the K likeliest bytes; 0: among all.")
_SEED = flags.DEFINE_integer("seed", 0, "The sampler's seed: the same seed, the same text.")


def main(argv):
    if len(argv) > 1:
        raise UserError(f"unexpected arguments {argv[1:]}")
    if not _WORKDIR.value:
        raise UserError("give --workdir=DIR, the folder of a language-model run")
    if _TEMPERATURE.value < 0 or _TOP_K.value < 0:
        raise UserError("--temperature and --top_k must be 0 or more")
    logging.set_verbosity(logging.WARNING)
    from tpu_keras.cluster import engine
    from tpu_keras.tools import sampling
    config = sampling.read_run_config(_WORKDIR.value)
    tokenizer = config.data.get("tokenizer", "bytes")
    if tokenizer != "bytes" and (config.data.get("text_files") or config.data.get("text_field")):
        raise UserError(f"{_WORKDIR.value} trained on data.tokenizer={tokenizer!r} tokens, and "
                        "generate reads and writes bytes; sample from a byte-level run")
    engine.select(config.engine)
    from tpu_keras.models import hub
    hub.import_keras_hub()  # its samplers serve every model: a one-line error without the extra
    model, step = sampling.load(_WORKDIR.value, config)
    prompt = _PROMPT.value.encode("utf-8")
    text = sampling.sample(model, prompt, _MAX_LENGTH.value or model.input_shape[1],
                           _TEMPERATURE.value, _TOP_K.value, _SEED.value)
    logging.info("sampled from step %d", step)
    print(text.decode("utf-8", errors="replace"))
    cli.exit_at_once(0)


if __name__ == "__main__":
    cli.run(main)
