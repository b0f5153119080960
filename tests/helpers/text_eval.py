"""Run by test_data.py: packed text's evaluation over every token once against numpy,
a TFDS text feature, SentencePiece by class and by preset, and instruction data's
response-only loss and metrics against numpy, in one process.

    python tests/helpers/text_eval.py DATA_DIR FOLDER SPM_PROTO
"""

from tpu_keras import lean_imports  # start as the command-line tools do

lean_imports.install()

import json, os, sys, numpy as np, keras, sentencepiece, tensorflow_datasets as tfds
import keras_hub
import tpu_keras
from tpu_keras import config as config_lib, data, models
from tpu_keras.data import text
from tpu_keras.models.metrics import bits_per_byte, bits_per_token_metric
import tiny_text  # registers the builder
data_dir, folder, spm = sys.argv[1:]
texts = ["def f(x):\n    return x * %d\n" % i * (i + 1) for i in range(6)] + ["ünïcödé ✓\n" * 9]
os.makedirs(f"{folder}/docs")
for i, body in enumerate(texts):
    open(f"{folder}/docs/{i}.txt", "w").write(body)
docs = f"{folder}/docs/*.txt"

# Evaluation over every token once, on 4 replicas: the toolkit against numpy.
cluster = tpu_keras.connect({"virtual_devices": 4})
config = config_lib.defaults()
config.data.text.update(files=docs, eval_files=docs)
config.data.tokens.context_length = 15
config.model = dict(name="gpt", vocab_size=256, context_length=15, width=32, depth=1, num_heads=2)
keras.utils.set_random_seed(1)
with cluster.scope():
    model = models.build(config.model)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=[
        keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="ce")])
tpu_keras.distributed_steps(model)
evaluation, steps = data.build(config.data, cluster, 8, training=False)
toolkit = model.evaluate(evaluation, steps=steps, verbose=0, return_dict=True)["ce"]
stream = np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8), 0) for t in texts])
rows = -(-len(stream) // 16)
tokens = np.zeros(rows * 16, np.int64)
tokens[:len(stream)] = stream
tokens, real = tokens.reshape(rows, 16), (np.arange(rows * 16) < len(stream)).reshape(rows, 16)[:, 1:]
logits = model.predict(tokens[:, :-1], verbose=0).astype(np.float64)
top = logits.max(-1, keepdims=True)
logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
nll = -np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
print("EVAL", len(stream), rows, steps, toolkit, nll[real].mean())

# A TFDS text feature.
tfds.builder("tiny_text", data_dir=data_dir).download_and_prepare()
tfds_config = config_lib.defaults().data
tfds_config.update(data_dir=data_dir)
tfds_config.tfds.name = "tiny_text"
tfds_config.text.field = "text"
tfds_config.tokens.context_length = 15
total = sum(len(tiny_text.line(i)) + 1 for i in range(40))
print("TFDS", data.build(tfds_config, cluster, 8, training=True)[1], total // 16 // 8)

# SentencePiece: a class with its proto, and the same tokenizer saved with a preset.
by_class = config_lib.defaults()
by_class.data.text.files = docs
by_class.data.tokens.update(tokenizer="SentencePieceTokenizer", vocabulary=spm, context_length=15)
source = text.open_source(by_class.data, training=True)
reference = [len(ids) + 1 for ids in sentencepiece.SentencePieceProcessor(model_file=spm).encode(texts)]
sequences = np.stack([s["tokens"] for s in source.read(source.files, True).as_numpy_iterator()])
kept = sum(reference) // 16 * 16  # training drops the tail that fills no sequence
print("SPM", source.tokenizer.vocabulary_size, list(source.tokens_per_file) == reference,
      sequences.max() < 1024, int((sequences == source.tokenizer.eos_id).sum()),
      int((np.cumsum(reference) <= kept).sum()))
keras_hub.models.LlamaBackbone(vocabulary_size=1024, num_layers=1, num_query_heads=2, hidden_dim=8,
                               num_key_value_heads=1, intermediate_dim=8).save_to_preset(f"{folder}/preset")
keras_hub.tokenizers.LlamaTokenizer(proto=spm).save_to_preset(f"{folder}/preset")
by_preset = config_lib.defaults()
by_preset.data.text.files = docs
by_preset.data.tokens.tokenizer = "preset"
by_preset.model = dict(name="keras_hub:LlamaCausalLM", preset=f"{folder}/preset", context_length=15)
by_preset.data.tokens.update(text.resolve(by_preset))
preset_source = text.open_source(by_preset.data, training=True)
preset_sequences = np.stack([s["tokens"] for s in preset_source.read(preset_source.files, True).as_numpy_iterator()])
print("PRESET", preset_source.tokenizer.name, np.array_equal(preset_sequences, sequences))

# Instructions: start, prompt, response, end; the prompt's tokens weigh exactly 0 in the loss
# (the mean over response targets) and the metrics, as numpy says; bits per byte over the
# responses' bytes alone.
pairs = [(f"Question {i}: what is {i} times {i + 1}?\n", f"It is {i * (i + 1)}." * (i % 3 + 1))
         for i in range(12)]
with open(f"{folder}/pairs.jsonl", "w") as lines:
    lines.writelines(json.dumps({"q": p, "a": r}) + "\n" for p, r in pairs)
instruct = config_lib.defaults()
instruct.data.instructions.update(files=f"{folder}/pairs.jsonl", eval_files=f"{folder}/pairs.jsonl",
                                  prompt_field="q", response_field="a")
instruct.data.tokens.update(tokenizer="LlamaTokenizer", vocabulary=spm, context_length=63)
instruct.model = dict(name="gpt", vocab_size=1024, context_length=63, width=32, depth=1, num_heads=2)
sp = sentencepiece.SentencePieceProcessor(model_file=spm)
examples = []  # each pair as packed: its tokens and weights (start, prompt at 0; response, end at 1)
for p, r in pairs:
    prompt, response = [sp.bos_id()] + sp.encode(p), sp.encode(r) + [sp.eos_id()]
    examples.append((prompt + response, [0] * len(prompt) + [1] * len(response)))
source = text.open_source(instruct.data, training=False)
packed = list(source.read(source.files, True).as_numpy_iterator())
stream, weights = np.stack([s["tokens"] for s in packed]), np.stack([s["mask"] for s in packed])
found = []  # each row's examples, split after each end token, with their weights
for row, mask in zip(stream, weights):
    cuts = [0] + [i + 1 for i in np.flatnonzero(row == sp.eos_id())]
    found += [(row[a:b].tolist(), mask[a:b].astype(int).tolist()) for a, b in zip(cuts, cuts[1:])]
    assert not mask[cuts[-1]:].any()  # after the last example: padding, weight 0
same = sorted(map(str, found)) == sorted(map(str, examples))  # each pair whole, once
response_bytes = sum(len(r.encode()) for _, r in pairs)
with cluster.scope():
    model = models.build(instruct.model)
    model.compile(loss=models.registry.get(instruct.model)[0].loss(),  # the builder's own loss
                  weighted_metrics=[bits_per_token_metric(),
                                    bits_per_byte(source.tokens_per_byte)])
tpu_keras.distributed_steps(model)
x, y, w = stream[:, :-1], stream[:, 1:], weights[:, 1:].astype(np.float32)
logits = model.predict(x, verbose=0)
loss = float(model.compute_loss(x=x, y=y, y_pred=logits, sample_weight=w))
noise = np.where(w == 0, (y + 1 + np.arange(y.size).reshape(y.shape)) % 1024, y)  # other targets
prompt_free = float(model.compute_loss(x=x, y=noise, y_pred=logits, sample_weight=w))
logits = logits.astype(np.float64)
top = logits.max(-1, keepdims=True)
logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
nll = -np.take_along_axis(logp, y[..., None], -1)[..., 0]
evaluation, steps = data.build(instruct.data, cluster, 8, training=False)
metrics = model.evaluate(evaluation, steps=steps, verbose=0, return_dict=True)
bits = (nll * w).sum() / w.sum() / np.log(2)  # per response token: the end token included
print("INSTRUCT", same, loss, (nll * w).sum() / w.sum(), prompt_free == loss, (nll * w).sum() / w.size,
      metrics["bits_per_token"], bits, metrics["bits_per_byte"], bits * source.tokens_per_byte,
      source.tokens_per_byte, weights.sum() / response_bytes)
