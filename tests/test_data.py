"""The input pipeline: exactly-once sharding per host and replica, padded
evaluation, determinism and the tf.data service."""

import json
import re
import sys

import pytest
import tensorflow as tf

from conftest import REPO, run_command, train

EXAMPLE_STRIDE = 100_000  # id = file * EXAMPLE_STRIDE + row: the id names its file


def write_files(directory, rows_per_file):
    """TFRecord files of examples {'id', 'x'}; returns the glob and all ids."""
    ids = []
    for file, rows in enumerate(rows_per_file):
        with tf.io.TFRecordWriter(str(directory / f"part-{file:03d}.tfrecord")) as writer:
            for row in range(rows):
                example_id = file * EXAMPLE_STRIDE + row
                ids.append(example_id)
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[example_id])),
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=[row, 1.0])),
                })).SerializeToString())
    return str(directory / "part-*.tfrecord"), ids


def probe(pattern, hosts, devices, global_batch, epochs=1, seed=0, data_service=False):
    """Runs tests/helpers/data_probe.py on every host; returns (per-host reports, output).

    `pattern` may join several globs with ','; the reports are then a dict by glob.
    `seed` may join several seeds with ','; the reports are then a list, one per seed.
    """
    result = run_command([sys.executable, "-m", "tpu_keras.launch", f"--hosts={hosts}",
                  f"--devices_per_host={devices}", "--timeout=240",
                  *(["--data_service"] if data_service else []), "--",
                  sys.executable, str(REPO / "tests" / "helpers" / "data_probe.py"), pattern,
                  str(global_batch), str(epochs), str(seed)], timeout=300)
    by_run = {}
    for line in re.findall(r"PROBE (.*)", result.stdout):
        report = json.loads(line)
        by_run.setdefault((report["pattern"], report["run"]), []).append(report)
    for reports in by_run.values():
        assert sorted(r["host"] for r in reports) == list(range(hosts))
        reports.sort(key=lambda r: r["host"])
    seeds = str(seed).split(",")
    assert sorted(by_run) == sorted((p, i) for p in pattern.split(",") for i in range(len(seeds)))
    if len(seeds) > 1:
        return [by_run[pattern, i] for i in range(len(seeds))], result.stdout
    by_pattern = {p: reports for (p, _), reports in by_run.items()}
    return (by_pattern if "," in pattern else by_pattern[pattern]), result.stdout


def ids_of_epoch(reports, epoch):
    return [i for r in reports for replica in r["seen"][epoch] for i in replica]


# One host of one device is the trivial case; the fast tier takes one host of four replicas.
@pytest.mark.parametrize("hosts, devices", [(1, 4), pytest.param(2, 2, marks=pytest.mark.slow),
                                            pytest.param(4, 1, marks=pytest.mark.slow)])
def test_each_example_exactly_once_per_epoch(tmp_path, hosts, devices):
    global_batch = 32
    file_sets = {}  # one start of the hosts reads both: 8 files that divide the batch, and not
    for name, rows_per_file in (("divides", [96] * 8), ("remainder", [101] * 8)):
        (tmp_path / name).mkdir()
        file_sets[name] = write_files(tmp_path / name, rows_per_file)
    by_pattern, output = probe(",".join(p for p, _ in file_sets.values()), hosts, devices, global_batch)
    assert "by file" in output and "by example" not in output
    for name, (pattern, all_ids) in file_sets.items():
        reports = by_pattern[pattern]
        seen = ids_of_epoch(reports, 0)
        assert len(seen) == len(set(seen)), f"{name}: an example was seen twice"
        assert set(seen) <= set(all_ids)
        missing = len(all_ids) - len(seen)
        if len(all_ids) % global_batch == 0:
            assert missing == 0, name
        else:
            assert missing < global_batch, name
        for report in reports:  # every replica got whole batches, and the same number
            assert {len(replica) for replica in report["seen"][0]} == {
                report["steps"] * global_batch // (hosts * devices)}
            # By file: host h reads files h, h + H, ... and nothing else.
            files = {i // EXAMPLE_STRIDE for replica in report["seen"][0] for i in replica}
            assert files <= set(range(report["host"], 8, hosts)), name


@pytest.mark.slow  # over 15 s: the full suite's (the fast tier keeps within 5 minutes)
def test_fewer_files_than_hosts_falls_back_to_examples_and_warns(tmp_path):
    pattern, all_ids = write_files(tmp_path, [128])
    reports, output = probe(pattern, hosts=2, devices=1, global_batch=16)
    seen = ids_of_epoch(reports, 0)
    assert sorted(seen) == sorted(all_ids)
    assert re.search(r"sharding .* by example: 1 file\(s\) for 2 hosts, so each host reads all "
                     r"128 examples to keep 64 \(2\.0x over-read\)", output)


@pytest.mark.slow
def test_same_seed_same_order_and_each_epoch_reshuffled(tmp_path):
    pattern, all_ids = write_files(tmp_path, [64] * 4)
    # One process builds the pipeline three times, from seeds 7, 7 and 8.
    (first, again, other), _ = probe(pattern, hosts=1, devices=1, global_batch=16, epochs=2,
                                     seed="7,7,8")
    epoch0, epoch1 = ids_of_epoch(first, 0), ids_of_epoch(first, 1)
    assert epoch0 == ids_of_epoch(again, 0) and epoch1 == ids_of_epoch(again, 1)
    assert sorted(epoch0) == sorted(epoch1) == sorted(all_ids)
    assert epoch0 != epoch1
    assert ids_of_epoch(other, 0) != epoch0
    assert epoch0 != sorted(epoch0)  # shuffled at all


@pytest.mark.slow
def test_tf_data_service_feeds_the_same_examples(tmp_path):
    pattern, all_ids = write_files(tmp_path, [96] * 4)
    served, output = probe(pattern, hosts=2, devices=1, global_batch=32, data_service=True)
    assert re.search(r"\[host [01]\].*through the tf.data service at grpc://", output)
    assert [r["steps"] for r in served] == [384 // 32] * 2  # as without the service
    assert sorted(ids_of_epoch(served, 0)) == sorted(all_ids)


DIGITS_EVAL = """
import sys, numpy as np, keras
sys.path.insert(0, "configs")
import digits
import tpu_keras
from tpu_keras import data, models
from tpu_keras.data.digits import TEST_EVERY, load_digits
config = digits.get_config()
config.data.data_dir = sys.argv[1]
cluster = tpu_keras.connect({"virtual_devices": 4})
with cluster.scope():
    model = models.build(config.model)
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"], steps_per_execution=4)
tpu_keras.distributed_steps(model)
evaluation, steps = data.build(config.data, cluster, 64, training=False)
toolkit = model.evaluate(evaluation, steps=steps, verbose=0, return_dict=True)["accuracy"]
images, labels = load_digits()
test = np.arange(len(labels)) % TEST_EVERY == 0
numpy = (model.predict(images[test] / 16.0, verbose=0).argmax(-1) == labels[test]).mean()
print("EVAL", int(test.sum()), steps, toolkit, numpy)
"""


@pytest.mark.slow
def test_evaluation_counts_every_example_once(data_dir):
    result = run_command([sys.executable, "-c", DIGITS_EVAL, data_dir])
    count, steps, toolkit, numpy = re.search(r"EVAL (\S+) (\S+) (\S+) (\S+)", result.stdout).groups()
    assert int(count) == 360 and int(steps) == 6  # 360 = 5 x 64 + 40: the last batch is padded
    assert float(toolkit) == pytest.approx(float(numpy), abs=1e-6)


@pytest.mark.slow
def test_training_run_through_the_tf_data_service(tmp_path, data_dir):
    result = run_command([sys.executable, "-m", "tpu_keras.launch", "--hosts=2", "--timeout=240",
                  "--data_service", "--", sys.executable, "-m", "tpu_keras.train",
                  "--config=configs/digits.py:tiny", f"--workdir={tmp_path}",
                  f"--config.data.data_dir={data_dir}"], timeout=300)
    assert re.search(r"\[host 0\].*digits\[train\].*through the tf.data service", result.stdout)
    # The same steps as without the service (test_train's two-host run).
    assert [int(s) for s in re.findall(r"\[host 0\].*step (\d+)/20 \|", result.stdout)] == [10, 20]


SLICED = """
import sys
from absl import logging
logging.set_verbosity(logging.INFO)
sys.path.insert(0, "configs")
import digits, tpu_keras
from tpu_keras import data
config = digits.get_config()
config.data.data_dir = sys.argv[1]
config.data.tfds.update(train_split="train[:50%]", eval_split="train[50%:]")
cluster = tpu_keras.connect({})
_, train_steps = data.build(config.data, cluster, 64, training=True)
_, eval_steps = data.build(config.data, cluster, 64, training=False)
print("STEPS", train_steps, eval_steps)
"""


@pytest.mark.slow
def test_tfds_split_slicing(data_dir):
    result = run_command([sys.executable, "-c", SLICED, data_dir])
    # 1437 examples: TFDS gives the first half 718 (11 full batches of 64) and
    # the second half 719 (12 batches, the last one padded).
    assert re.search(r"sharding digits\[train\[:50%\]\] by file: 4 file\(s\) over 1 host\(s\), 718 ",
                     result.stdout)
    assert "STEPS 11 12" in result.stdout


TFRECORD_SPLITS = """
import sys, tpu_keras
from tpu_keras import config as config_lib, data
config = config_lib.defaults().data
config.tfrecords.update(files=sys.argv[1], eval_files=sys.argv[2], features={"id": "int64", "x": "float32[2]"})
config.update(preprocess="features", inputs="x", targets="id")
cluster = tpu_keras.connect({})
print("STEPS", data.build(config, cluster, 16, training=True)[1], data.build(config, cluster, 16, training=False)[1])
"""


@pytest.mark.slow
def test_tfrecord_train_and_eval_files_are_separate(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "eval").mkdir()
    train_pattern, _ = write_files(tmp_path / "train", [64] * 2)
    eval_pattern, _ = write_files(tmp_path / "eval", [20])
    result = run_command([sys.executable, "-c", TFRECORD_SPLITS, train_pattern, eval_pattern])
    assert "STEPS 8 2" in result.stdout  # 128 / 16 train steps; 20 eval rows -> 2 padded steps


# ----- text: tokenized and packed -------------------------------------------------

TEXT_CONTEXT = 15  # sequences of 16 tokens


def write_text(directory):
    """Three text sets: 8 .txt documents of 128 tokens each (EOS included), which divide
    into whole batches, 4 .jsonl files of documents of uneven lengths, some
    non-ASCII, and 4 .jsonl files of prompts and responses; and a bad set.
    Returns {glob: {document id: token count}} of the three."""
    (directory / "txt").mkdir()
    (directory / "jsonl").mkdir()
    txt = {}
    for file in range(8):
        text = "".join(chr(ord("a") + (file + i) % 26) for i in range(127))  # + EOS: 128
        (directory / "txt" / f"doc-{file}.txt").write_text(text)
        txt[file * 2 ** 32] = 128
    jsonl = {}
    for file in range(4):
        with open(directory / "jsonl" / f"part-{file}.jsonl", "w") as lines:
            for line in range(5):
                text = f"é{file}{line} " * (3 + 7 * line + file)
                lines.write(json.dumps({"text": text, "id": line}) + "\n")
                jsonl[file * 2 ** 32 + line] = len(text.encode()) + 1
    (directory / "apart").mkdir()  # the same documents, packed apart: each long one in pieces
    for file in range(4):
        (directory / "apart" / f"part-{file}.jsonl").write_text(
            (directory / "jsonl" / f"part-{file}.jsonl").read_text())
    apart = {doc + 0: count for doc, count in jsonl.items()}
    (directory / "instructions").mkdir()
    instructions = {}  # 4 files of 6 prompts and responses: bytes, no start token, an end token
    for file in range(4):  # 9 to 16 tokens each: several to a row of 16, none longer
        with open(directory / "instructions" / f"part-{file}.jsonl", "w") as lines:
            for line in range(6):
                pair = {"prompt": f"Q{file}.{line}: " + "ü" * (line // 2), "response": "ok" + "!" * file}
                lines.write(json.dumps(pair) + "\n")
                instructions[file * 2 ** 32 + line] = len("".join(pair.values()).encode()) + 1
    (directory / "bad").mkdir()  # file 1, host 1's on two hosts, has a line without a response
    for file in range(2):
        (directory / "bad" / f"part-{file}.jsonl").write_text(
            '{"prompt": "a", "response": "b"}\n' + ('{"prompt": "c"}\n' if file else ""))
    return {str(directory / "txt" / "*.txt"): txt, str(directory / "jsonl" / "*.jsonl"): jsonl,
            str(directory / "instructions" / "*.jsonl"): instructions,
            str(directory / "apart" / "*.jsonl"): apart}


def logged_tokens(folder):
    """{(host, batch position): [(document id, position), ...]} from the example logs."""
    import glob, numpy as np
    seen = {}
    for path in glob.glob(f"{folder}/host*.txt"):
        host = int(re.search(r"host(\d+)\.txt$", path).group(1))
        for position, ids in re.findall(r"^(\d+) (\[[^a-z]*?\]\]\])$", open(path).read(), re.M):
            pairs = np.array(re.findall(r"-?\d+", ids), np.int64).reshape(-1, 2)
            seen.setdefault((host, int(position)), []).extend(map(tuple, pairs.tolist()))
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("hosts, devices", [(2, 2)])  # hosts and replicas at once
def test_text_tokens_exactly_once_per_epoch_and_resume(tmp_path, hosts, devices):
    """Text, .jsonl text, the same packed apart and instructions (packed apart): every token
    once per epoch, each pair (each piece of a row of a document) whole in one row, a resumed
    run on its batch; each host tokenizes only its own files at start-up, none on a restart."""
    global_batch = 8
    documents = write_text(tmp_path)
    bad = str(tmp_path / "bad" / "*.jsonl")
    result = run_command([sys.executable, "-m", "tpu_keras.launch", f"--hosts={hosts}",
                  f"--devices_per_host={devices}", "--timeout=240", "--",
                  sys.executable, str(REPO / "tests" / "helpers" / "text_probe.py"), str(tmp_path / "logs"),
                  ",".join([*documents, bad]), str(global_batch), str(TEXT_CONTEXT)], timeout=300)
    reports = [json.loads(line) for line in re.findall(r"PROBE (.*)", result.stdout)]
    assert len(reports) == 4 * hosts
    # A bad line in one host's file stops every host, on the same line.
    errors = re.findall(r"PROBE_ERROR (\d) (.*)", result.stdout)
    assert sorted(int(host) for host, _ in errors) == list(range(hosts))
    assert {message for _, message in errors} == {
        f"{tmp_path}/bad/part-1.jsonl:2 has no text under data.instructions.response_field='response'; "
        "set data.instructions.response_field to the key of the response (this line has ['prompt'])"}
    for index, (pattern, lengths) in enumerate(documents.items()):
        steps = {r["steps"] for r in reports if r["pattern"] == pattern}
        assert len(steps) == 1
        steps = steps.pop()
        # At start-up a host tokenizes the documents of its own files (a prompt and a
        # response apart), on a restart none.
        per_document = 2 if "instructions" in pattern else 1
        for report in (r for r in reports if r["pattern"] == pattern):
            own = sum(1 for doc in lengths if (doc // 2 ** 32) % hosts == report["host"])
            assert report["tokenized"] == [own * per_document, 0], (pattern, report)
        logged = logged_tokens(tmp_path / "logs" / str(index) / "epoch")
        every = [token for (host, position), tokens in logged.items() if position < steps
                 for token in tokens]
        assert len(every) == steps * global_batch * (TEXT_CONTEXT + 1)  # full rows
        expected = {(doc, position) for doc, count in lengths.items() for position in range(count)}
        epoch = [token for token in every if token[0] >= 0]  # padding's ids are -1
        assert len(set(epoch)) == len(epoch), f"{pattern}: a token was seen twice"
        assert set(epoch) <= expected
        if "instructions" in pattern:  # packed apart: each pair whole in one row, so each seen
            seen = {doc for doc, _ in epoch}  # is seen with all its tokens; a few rows left out
            assert {token for token in expected if token[0] in seen} == set(epoch)
            assert len(lengths) - len(seen) < hosts * (global_batch // hosts + 1) * 2
        elif "apart" in pattern:  # documents in pieces of a row: each piece seen whole or not
            row = TEXT_CONTEXT + 1
            seen = {(doc, position // row) for doc, position in epoch}
            assert {(doc, p) for doc, p in expected if (doc, p // row) in seen} == set(epoch)
        elif index == 0:  # 8 x 128 tokens divide into whole global batches: nothing left out
            assert len(epoch) == len(every) and set(epoch) == expected
        else:  # one stream: no padding
            assert len(epoch) == len(every)
            assert len(expected) - len(epoch) < hosts * (global_batch // hosts + 1) * (TEXT_CONTEXT + 1)
        # Resumed at the middle step, each host starts on the very batch it fed there.
        resumed = logged_tokens(tmp_path / "logs" / str(index) / "resumed")
        for host in range(hosts):
            assert sorted(resumed[host, steps // 2]) == sorted(logged[host, steps // 2])


@pytest.mark.slow
def test_packed_text_evaluation_tfds_text_and_sentencepiece(tmp_path, data_dir, stdlib_text):
    """One process: evaluation over every token once equals numpy; a TFDS text feature
    packs; SentencePiece by class and by preset tokenize alike, as sentencepiece does."""
    result = run_command([sys.executable, str(REPO / "tests" / "helpers" / "text_eval.py"), data_dir, str(tmp_path),
                  str(stdlib_text / "spm1024.model")])
    tokens, rows, steps, toolkit, numpy = re.search(r"EVAL (\S+) (\S+) (\S+) (\S+) (\S+)",
                                                    result.stdout).groups()
    assert int(steps) == -(-int(rows) // 8) and int(tokens) % 16  # the last row and batch padded
    assert float(toolkit) == pytest.approx(float(numpy), abs=1e-6)
    steps, expected = re.search(r"TFDS (\d+) (\d+)", result.stdout).groups()
    assert int(steps) == int(expected) > 0
    eos = re.search(r"SPM 1024 True True (\d+) (\d+)", result.stdout)
    assert eos and int(eos.group(1)) in (6, 7), result.stdout[-2000:]  # 7 documents, the tail cut
    assert eos.group(1) == eos.group(2)  # exactly the documents that end before the cut
    assert "PRESET preset " in result.stdout and re.search(r"PRESET .* True", result.stdout)
    # Instructions, packed apart: every pair is whole in one row, exactly once, with numpy's
    # tokens and weights (start, prompt at 0, response and end at 1), padding at 0; the loss is
    # numpy's mean over response targets alone, whatever the prompt targets are; bits per token
    # over the response tokens, per byte over the response bytes.
    same, loss, reference, prompt_free, over_every_position, bits, bits_ref, per_byte, per_byte_ref, \
        tokens_per_byte, tokens_per_byte_ref = re.search(r"INSTRUCT (.*)", result.stdout).group(1).split()
    assert same == "True" and prompt_free == "True"
    assert float(loss) == pytest.approx(float(reference), rel=1e-6)
    assert float(loss) > float(over_every_position) * 1.5  # not divided by the prompt targets too
    assert float(bits) == pytest.approx(float(bits_ref), rel=1e-6)
    assert float(per_byte) == pytest.approx(float(per_byte_ref), rel=1e-6)
    assert float(tokens_per_byte) == pytest.approx(float(tokens_per_byte_ref), rel=1e-12)


@pytest.mark.slow
def test_instruction_tuning_learns_a_fixed_response(tmp_path):
    """configs/instruct_stdlib.py:tiny on prompts that all get one response: the loss on the
    responses (val bits per token, counted on them alone) falls by half in 20 steps. On an
    empty data_dir: the run writes the SentencePiece vocabulary it reads itself."""
    data_dir = tmp_path / "empty_home"
    with open(tmp_path / "pairs.jsonl", "w") as pairs:
        for i in range(1000):
            pairs.write(json.dumps({"prompt": f"Tell me about item {i}.\n",
                                    "response": "I do not know that one."}) + "\n")
    result = train("configs/instruct_stdlib.py:tiny", tmp_path / "run",
                   f"--config.data.data_dir={data_dir}", f"--config.data.instructions.files={tmp_path}/pairs.jsonl",
                   f"--config.data.instructions.eval_files={tmp_path}/pairs.jsonl",
                   "--config.train.learning_rate=0.02")
    assert "tokens per byte (of the responses)" in result.stdout
    first, last = (float(v) for v in re.findall(r"val_bits_per_token ([\d.]+)", result.stdout))
    assert last < first / 2, result.stdout[-2000:]
    # The run's generator gives the model a prompt as training gave it one: start token first.
    out = run_command([sys.executable, "-c", GENERATOR_PROMPT, str(tmp_path / "run")]).stdout
    generated, given, trained, start = json.loads(out.splitlines()[-1])
    assert given == trained and given[0] == start, (given, trained, start)
    assert generated.startswith("Tell me about item 5.\n") and len(generated) > 22, generated


GENERATOR_PROMPT = """
import json, sys
import tensorflow as tf
from tpu_keras.data import text, tokenizers
from tpu_keras import config as config_lib
from tpu_keras.tools import generation
config = config_lib.read_run_config(sys.argv[1])
generator = generation.from_run(sys.argv[1], config)
prompt = "Tell me about item 5.\\n"
tokenizer = tokenizers.make(text.with_data_dir(config.data).tokens)
tokens, _, prompt_tokens = text.document_recipe(config.data).tokenize(
    tokenizer, {"prompt": tf.constant([prompt]), "response": tf.constant(["x"])})
trained = [int(t) for t in tokens[0][:int(prompt_tokens[0])].numpy()]
generated = generator.generate([prompt], 40, generation.make_sampler(0, 0, 0))[0]
print(json.dumps([generated, generator.encode(prompt), trained, tokenizer.start_id]))
"""


def test_a_token_count_whose_counting_host_died_ends_in_bounded_time(tmp_path):
    """Host 0 of 2 counts its file; host 1 never writes the other's record (it died): host 0
    stops after its wait with one line naming host 1 and the file, instead of polling forever."""
    from tpu_keras.data import sources, token_counts
    from tpu_keras.errors import UserError
    paths = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for path in paths:
        path.write_text("some text\n")
    files = [sources.FileSlice(str(path), 0, 1) for path in paths]
    with pytest.raises(UserError) as refused:
        token_counts.gather(files, "recipe", lambda indices: {i: {"tokens": 3} for i in indices},
                            str(tmp_path / "counts"), 0, 2, wait_seconds=1)
    message = str(refused.value)
    assert "\n" not in message and "host 1" in message and str(paths[1]) in message, message
    assert "data.tokens.counts" in message, message
    # The record host 0 wrote stays: a restart counts nothing it already counted.
    assert len([n for n in (tmp_path / "counts").iterdir() if n.suffix == ".json"]) == 1


ONE_TOKENIZER_GRAPH = """
import json, sys
from tpu_keras import lean_imports
lean_imports.install()
import ml_collections
import tensorflow as tf
from tpu_keras.data import tokenizers
folder = sys.argv[1]
tokenizer = tokenizers.make(ml_collections.ConfigDict({"tokenizer": "BytePairTokenizer",
    "vocabulary": f"{folder}/vocab.json", "merges": f"{folder}/merges.txt"}))
built = []  # one entry per graph of keras-hub's layer that a trace built
layer_tokenize = tokenizer.layer.tokenize
def counted(texts):
    if not tf.executing_eagerly():
        built.append(1)
    return layer_tokenize(texts)
tokenizer.layer.tokenize = counted
texts = ["ab ab", "ba a", "b"]
pipelines = [tf.data.Dataset.from_tensor_slices(texts).batch(2).map(
    lambda block: tokenizer.tokenize(block).to_tensor(-1)) for _ in range(3)]  # counts, train, eval
read = [[batch.tolist() for batch in pipeline.as_numpy_iterator()] for pipeline in pipelines]
eager = tokenizer.tokenize(tf.constant(texts)).to_list()  # a prompt's call, as GRPO's
print(json.dumps({"graphs": len(built), "read": read, "eager": eager}))
"""


def test_a_keras_hub_tokenizer_is_one_graph_for_every_pipeline_of_a_process(tmp_path):
    """A run's tf.data pipelines (token counts, training, evaluation) call one graph of a
    keras-hub tokenizer rather than each tracing its own (seconds apiece for a byte-pair
    tokenizer), and its ids are the merges' own. An eager call gets the same graph and its
    ragged ids on the jax engine too (keras-hub's eager call there gives Python lists)."""
    (tmp_path / "vocab.json").write_text(json.dumps(
        {"a": 0, "b": 1, "ab": 2, "Ġ": 3, "Ġa": 4, "Ġb": 5, "Ġab": 6, "<|endoftext|>": 7}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\nĠ a\nĠ b\nĠa b\n")
    out = run_command([sys.executable, "-c", ONE_TOKENIZER_GRAPH, str(tmp_path)],
                      env={"KERAS_BACKEND": "jax"}).stdout  # as the jax engine sets it
    result = json.loads(out.splitlines()[-1])
    assert result["graphs"] == 1, result
    # "ab", "Ġ", "ab" | "b", "a", "Ġa" | "b": as keras-hub's byte-pair tokenizer splits and
    # merges them, in batches of 2 padded with -1, the same in every pipeline
    assert all(read == [[[2, 3, 2], [1, 0, 4]], [[1]]] for read in result["read"]), result
    assert result["eager"] == [[2, 3, 2], [1, 0, 4], [1]], result
