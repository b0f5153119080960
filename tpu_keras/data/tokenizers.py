"""Tokenizers for the text sources: raw bytes, or a keras-hub tokenizer.

`data.tokens.tokenizer` names one:

- `bytes`: each UTF-8 byte is its token (vocabulary 256, as `stdlib_bytes`,
  so byte-level models read either source). Byte 0 (NUL, which text files
  do not hold) is the end-of-document token: the vocabulary stays 256.
  There is no start token (a byte model has no id to spare for one).
- a keras-hub tokenizer class (`SentencePieceTokenizer`, `BytePairTokenizer`,
  `LlamaTokenizer`, ...) with its vocabulary file in `data.tokens.vocabulary` (a
  SentencePiece proto; a BPE `vocab.json`, with `data.tokens.merges`).
- `preset`: the tokenizer saved with `model.preset`, so the data and the
  model cannot disagree on the vocabulary.

A keras-hub tokenizer's own `start_token_id` and `end_token_id` are the
start and end tokens (instruction data begins each example with the start
token, where the tokenizer has one). `fingerprint` names the tokenizer's
exact vocabulary, so counts made with one are never read for another.

All of them tokenize a whole block of documents at once inside tf.data
(graph ops: keras-hub tokenizers are TensorFlow preprocessing layers).
"""

# Imported inside functions: keras-hub (optional: absent on a plain install), and
# tpu_keras.models.hub_presets, which reads a preset with it (and loads Keras).
import dataclasses
import hashlib
import inspect
import json
import os
from typing import Callable, Optional

import tensorflow as tf

from tpu_keras.errors import UserError, closest, first_line

BYTES = "bytes"
PRESET = "preset"
BYTES_EOS = 0
# End-of-sequence pieces, in the order they are looked for, when the tokenizer has no end_token_id.
_EOS_PIECES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[SEP]")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    name: str
    vocabulary_size: int
    eos_id: int
    # A [batch] string tensor -> a ragged [batch, None] int32 tensor of token ids.
    tokenize: Callable[[tf.Tensor], tf.RaggedTensor] = dataclasses.field(compare=False)
    start_id: Optional[int] = None
    fingerprint: str = BYTES  # a hash of the vocabulary, merges and special tokens
    layer: object = dataclasses.field(default=None, compare=False)  # keras-hub's; None: bytes


def make(config) -> Tokenizer:
    """The tokenizer `config` (the `data.tokens` part) names; a one-line error if it cannot be made."""
    choice = config.tokenizer
    if choice == BYTES:
        return Tokenizer(BYTES, 256, BYTES_EOS, _bytes)
    keras_hub = _keras_hub(choice)
    if choice == PRESET:
        if not config.vocabulary:
            raise UserError("data.tokens.tokenizer='preset' reads the tokenizer of model.preset, which is "
                            "empty; set model.preset, or name a tokenizer class and data.tokens.vocabulary")
        from tpu_keras.models import hub_presets
        try:  # a tokenizer file there that cannot be read: hub_presets' one-line error
            layer = hub_presets.load_tokenizer(config.vocabulary)
        except (ValueError, FileNotFoundError, OSError) as error:
            raise UserError(f"model.preset={config.vocabulary!r} has no tokenizer to read "
                            f"({first_line(error, 120)}); save one with "
                            "tokenizer.save_to_preset, or set data.tokens.tokenizer to a class and "
                            "data.tokens.vocabulary") from None
        return _wrap(f"preset {config.vocabulary}", layer)
    classes = {name: value for name, value in vars(keras_hub.tokenizers).items()
               if isinstance(value, type) and issubclass(value, keras_hub.tokenizers.Tokenizer)}
    if choice not in classes:
        raise UserError(f"data.tokens.tokenizer={choice!r} is not 'bytes', 'preset' or a keras_hub "
                        f"tokenizer class{closest(choice, classes)}; use one such as "
                        "'SentencePieceTokenizer' or 'LlamaTokenizer'")
    if not config.vocabulary:
        raise UserError(f"data.tokens.tokenizer={choice!r} needs its vocabulary file; set "
                        "data.tokens.vocabulary (a SentencePiece proto, or a BPE vocab.json)")
    for key in ("vocabulary", "merges"):
        path = config[key]
        if path and not tf.io.gfile.exists(path):
            raise UserError(f"data.tokens.{key}={path!r} does not exist; set it to the tokenizer's file")
    cls = classes[choice]
    parameters = inspect.signature(cls.__init__).parameters
    if "proto" in parameters:
        layer = cls(proto=config.vocabulary)
    elif "merges" in parameters:
        if not config.merges:
            raise UserError(f"data.tokens.tokenizer={choice!r} is a byte-pair tokenizer; set "
                            "data.tokens.merges to its merges.txt beside data.tokens.vocabulary")
        layer = cls(vocabulary=config.vocabulary, merges=config.merges)
    else:
        layer = cls(vocabulary=config.vocabulary)
    return _wrap(f"{choice}({os.path.basename(config.vocabulary)})", layer)


def decode(tokenizer: Tokenizer, ids) -> str:
    """The text of token ids. Bytes: an id past them (a model's larger vocabulary) reads as
    U+FFFD, as do bytes that are not UTF-8."""
    if tokenizer.layer is None:
        return b"".join(bytes([i]) if i < 256 else "\ufffd".encode() for i in ids).decode(
            "utf-8", errors="replace")
    value = tokenizer.layer.detokenize(tf.constant(list(ids), tf.int32))
    value = value.numpy() if hasattr(value, "numpy") else value
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _bytes(texts):
    """Every document's UTF-8 bytes, as one ragged batch (one decode for the block)."""
    values = tf.io.decode_raw(tf.strings.reduce_join(texts), tf.uint8)
    return tf.RaggedTensor.from_row_lengths(tf.cast(values, tf.int32),
                                            tf.cast(tf.strings.length(texts), tf.int64))


def _wrap(name, layer) -> Tokenizer:
    eos = getattr(layer, "end_token_id", None)
    if eos is None:
        vocabulary = list(layer.get_vocabulary())  # a byte-pair tokenizer's is dict keys
        eos = next((vocabulary.index(p) for p in _EOS_PIECES if p in vocabulary), None)
    if eos is None:
        raise UserError(f"the tokenizer {name} has no end-of-sequence token (none of "
                        f"{list(_EOS_PIECES)}); use a vocabulary that has one")

    def ids(texts):
        return tf.cast(layer.tokenize(texts), tf.int32)

    # One graph for the process, which every pipeline (token counts, training, evaluation)
    # calls instead of tracing its own; keras-hub's code is graph code, so AutoGraph is off.
    # Eager calls use it too: keras-hub 0.32's eager call on the jax backend gives Python
    # lists, the graph ragged ids on both engines. Why and the figures: docs/design.md.
    tokenize = tf.function(ids, input_signature=[tf.TensorSpec([None], tf.string)], autograph=False)
    start = getattr(layer, "start_token_id", None)
    start = None if start is None else int(start)
    return Tokenizer(name, int(layer.vocabulary_size()), int(eos), tokenize, start,
                     _fingerprint(layer, start, int(eos)), layer)


def _fingerprint(layer, start, end) -> str:
    """A hash of what decides the ids: the class, its vocabulary (a SentencePiece proto,
    a BPE vocabulary and merges, a word list) and its start and end tokens."""
    digest = hashlib.sha256(json.dumps([type(layer).__name__, start, end]).encode())
    for name in ("proto", "vocabulary", "merges"):
        value = getattr(layer, name, None)
        if value is not None:
            digest.update(value if isinstance(value, bytes) else
                          json.dumps(value, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def _keras_hub(choice):
    try:
        import keras_hub
    except ImportError:
        raise UserError(f"data.tokens.tokenizer={choice!r} needs keras-hub: pip install -e \".[hub]\", "
                        "or use data.tokens.tokenizer='bytes'") from None
    return keras_hub
