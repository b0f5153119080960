"""The standard library as text documents, with a SentencePiece vocabulary, offline.

The text-source counterpart of `stdlib_bytes`: the same files and the same
train/validation split, but one `.txt` document per source file, so the
tokenize-and-pack path (`tpu_keras.data.text`) runs end to end on every
machine without a download. `prepare(data_dir)` writes, once:

    data_dir/stdlib_text/train/*.txt, validation/*.txt
    data_dir/stdlib_text/spm1024.model

The vocabulary is a 1,024-piece unigram SentencePiece model that
`keras_hub.tokenizers.compute_sentence_piece_proto` trains on the first
`VOCABULARY_BYTES` of the train split's lines: the same input gives the same
proto. Its default normalization folds runs of whitespace and newlines, so
the pieces do not keep Python's indentation: bits per byte measured with it
are not the lossless figure a byte model's are (README "Data").
"""

import os

from tpu_keras.data import builders, stdlib_bytes

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
    with builders.exclusive(os.path.expanduser(data_dir)):
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
    import tensorflow as tf
    from keras_hub.tokenizers import compute_sentence_piece_proto
    text = stdlib_bytes.split_stream("train")[:VOCABULARY_BYTES].decode("utf-8", "replace")
    lines = tf.data.Dataset.from_tensor_slices([line for line in text.splitlines() if line.strip()])
    compute_sentence_piece_proto(lines, VOCABULARY_SIZE, proto_output_file=path)
