"""Writes two tiny keras-hub causal LM presets and keras-hub's own greedy texts for them.

    python tests/helpers/generate_probe.py FOLDER

FOLDER/llama: a LlamaCausalLM whose LlamaTokenizer reads a SentencePiece
proto trained here by the sentencepiece library; FOLDER/gpt2: a GPT2CausalLM
whose byte-pair GPT2Tokenizer reads a vocabulary and merges written here.
FOLDER/prompts.jsonl holds the prompts. Prints one JSON line: for each
preset, `CausalLM.generate(prompts)` with a greedy sampler on the weights
read back from the preset, the whole batch at once.
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import io
import json
import os
import sys

folder = sys.argv[1]
os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402
import keras_hub  # noqa: E402
import sentencepiece  # noqa: E402

PROMPTS = ["def main(", "import os", "class Error", "x"]
MAX_LENGTH = 24
SOURCE = [line for path in ("json/decoder.py", "json/encoder.py", "textwrap.py")
          for line in open(os.path.join(os.path.dirname(os.__file__), path)).read().splitlines()
          if line.strip()]  # the standard library's own text: there offline


def sentencepiece_proto() -> bytes:
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SOURCE), model_writer=proto, vocab_size=400, model_type="bpe",
        byte_fallback=True, num_threads=1, minloglevel=2)
    return proto.getvalue()


def byte_pair_vocabulary():
    """GPT-2's byte-to-character map, the 256 bytes, a few merges over them and, last as in
    GPT-2's own, the end token."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    char = {b: chr(b if b in printable else next(shifted)) for b in range(256)}
    vocabulary = {char[b]: b for b in range(256)}
    merges = []
    for left, right in (("Ġ", "i"), ("e", "r"), ("Ġi", "m"), ("d", "e"), ("de", "f"),
                        ("o", "r"), ("Ġim", "p"), ("s", "e"), ("l", "f")):
        merges.append(f"{left} {right}")
        vocabulary[left + right] = len(vocabulary)
    vocabulary["<|endoftext|>"] = len(vocabulary)
    return vocabulary, merges


keras.utils.set_random_seed(3)
spm = keras_hub.models.LlamaTokenizer(proto=sentencepiece_proto())
vocabulary, merges = byte_pair_vocabulary()
bpe = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
tasks = {
    "llama": keras_hub.models.LlamaCausalLM(
        backbone=keras_hub.models.LlamaBackbone(
            vocabulary_size=spm.vocabulary_size(), num_layers=1, num_query_heads=2,
            num_key_value_heads=1, hidden_dim=32, intermediate_dim=64),
        preprocessor=keras_hub.models.LlamaCausalLMPreprocessor(spm, sequence_length=MAX_LENGTH)),
    "gpt2": keras_hub.models.GPT2CausalLM(
        backbone=keras_hub.models.GPT2Backbone(
            vocabulary_size=bpe.vocabulary_size(), num_layers=1, num_heads=2, hidden_dim=32,
            intermediate_dim=64, max_sequence_length=MAX_LENGTH),
        preprocessor=keras_hub.models.GPT2CausalLMPreprocessor(bpe, sequence_length=MAX_LENGTH)),
}
with open(os.path.join(folder, "prompts.jsonl"), "w") as file:
    file.writelines(json.dumps({"prompt": prompt, "id": i}) + "\n" for i, prompt in enumerate(PROMPTS))
texts = {}
for name, task in tasks.items():
    task.save_to_preset(os.path.join(folder, name))
    reloaded = keras_hub.models.CausalLM.from_preset(os.path.join(folder, name))
    reloaded.compile(sampler="greedy")
    texts[name] = reloaded.generate(PROMPTS)
print("GREEDY " + json.dumps(texts), flush=True)
