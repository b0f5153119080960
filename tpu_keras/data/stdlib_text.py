"""The standard library as text documents, with a SentencePiece vocabulary, offline.

The text-source counterpart of `stdlib_bytes`: the same files and the same
train/validation split, but one `.txt` document per source file, so the
tokenize-and-pack path (`tpu_keras.data.text`) runs end to end on every
machine without a download. `prepare(data_dir)` writes, once:

    data_dir/stdlib_text/train/*.txt, validation/*.txt
    data_dir/stdlib_text/spm1024.model

The vocabulary is a 1,024-piece unigram SentencePiece model trained on the
first `VOCABULARY_BYTES` of the train split, one thread, so the same input
gives the same proto. It is lossless, so that its bits per byte compare with
a byte model's: no normalization (identity), whitespace kept as it is (runs
of spaces may be pieces: Python's indentation), a piece for the newline, and
bytes for any character outside the pieces (byte fallback). keras-hub's
`compute_sentence_piece_proto` keeps SentencePiece's default normalization,
which folds whitespace and drops newlines (a quarter of this corpus's
bytes), and takes no option to change it, so the trainer is called directly.
"""

# Imported inside functions: SentencePiece (optional: absent on a plain install).
import os

from tpu_keras.data import offline, stdlib_bytes

NAME = "stdlib_text"
VOCABULARY = "spm1024.model"
VOCABULARY_SIZE = 1024
VOCABULARY_BYTES = 1_000_000


def folder(data_dir: str) -> str:
    return os.path.join(os.path.expanduser(data_dir), NAME)


def prepare(data_dir: str) -> str:
    """Writes the corpus and the vocabulary under `data_dir` unless they are there; returns
    the folder. Several processes may call it at once (they take turns on a lock)."""
    target = folder(data_dir)
    if os.path.exists(os.path.join(target, VOCABULARY)):
        return target
    with offline.exclusive(os.path.expanduser(data_dir)):
        if os.path.exists(os.path.join(target, VOCABULARY)):
            return target
        partial = target + ".partial"
        for split in stdlib_bytes.NUM_SHARDS:
            os.makedirs(os.path.join(partial, split), exist_ok=True)
        for path, split in stdlib_bytes.stdlib_files():
            name = path.replace("/", "__")[:-len(".py")] + ".txt"
            with open(os.path.join(partial, split, name), "wb") as file:
                file.write((stdlib_bytes.STDLIB_ROOT / path).read_bytes())
        _train_vocabulary(os.path.join(partial, VOCABULARY))
        os.rename(partial, target)
    return target


def _train_vocabulary(path: str) -> None:
    import sentencepiece  # a dependency of keras-hub, whose tokenizer reads the proto
    text = stdlib_bytes.split_stream("train")[:VOCABULARY_BYTES].decode("utf-8", "replace")
    with open(path, "wb") as proto:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter([line for line in text.split("\n") if line.strip()]),
            model_writer=proto, vocab_size=VOCABULARY_SIZE, model_type="unigram",
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, allow_whitespace_only_pieces=True, byte_fallback=True,
            user_defined_symbols=["\n"], num_threads=1, minloglevel=2)
